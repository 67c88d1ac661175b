"""Execution order, prefetch, the in-flight bound and end-of-backward work, shared by a root's units.

The root unit (the first unit to run forward) creates one Schedule for every unit in its module
tree. The schedule records the order in which units run forward; from the second step on it
prefetches: in forward, the all-gathers of the next `forward_prefetch` units are issued before the
current unit computes; in backward, those of the previous `backward_prefetch` units (in reverse
forward order). A bound on transient unsharded units keeps memory at most (depth + 1) units above
the sharded state: a prefetch that would exceed it is skipped and happens on demand instead.

The units it orders are `unit.Unit`s; a unit creates its root's schedule, so this module does not
import `unit` (annotations name "Unit" as text only).
"""
from __future__ import annotations

import warnings
from collections import deque
from enum import Enum, auto

import torch

from ..comm import collectives as comm, process_groups
from ..core import streams
from ..comm.collective_tags import CollectiveChecker
from ..core.host_reads import HostReads
from ..core.registry import unit_name, units_with_paths
from ..core.trace import RECORDER
from .states import move

SINGLE_PROCESS = (
    "fsdp_ext: no process group and no launcher: this is one process and nothing is sharded "
    "(world size 1). To shard, launch with torchrun (fully_shard then initialises the default "
    "group, as torch's does) or call torch.distributed.init_process_group() first.")


class Phase(Enum):
    """Where the root's step is (moved by `move`, like a unit's states).

        IDLE --root pre-forward--> FORWARD --root post-forward--> IDLE --first backward hook-->
        BACKWARD (its end-of-backward callback queued) --end of backward--> IDLE
    A backward may also start inside the root's forward (FORWARD -> BACKWARD)."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


class Schedule:
    def __init__(self, root: Unit, units: list[Unit], standalone: bool = False):
        self.root = root
        # Made by unshard() before any forward (create_standalone): the root's schedule replaces it.
        self.standalone = standalone
        self.units = units
        self.options = root.options  # the root's own record: setters on the root write it
        environment = root.config.env
        timeout = comm.collective_timeout(self.options.collective_timeout,
                                          environment.collective_timeout)
        shared = self.options.comm_ctx  # share_comm_ctx: roots that share their streams
        made = comm.Streams(root.groups.device, timeout, environment.issue_thread)
        self.streams = shared.setdefault("streams", made) if shared is not None else made
        self.checker = CollectiveChecker(root.groups.device, timeout=timeout,
                                         side_streams=self.streams.side,
                                         mode=environment.check_mode)
        # Before any collective, bounded: a rank that fails before its first all-gather leaves
        # the others in a wait that names it, not in a group creation (process_groups.py).
        process_groups.make_first_forward_groups(units, self.streams.issue_thread, timeout)
        self.forward_order: list[Unit] = []
        self._position: dict[Unit, int] = {}   # unit -> index in forward_order (prefetch lookups)
        self._recording: dict[Unit, None] = {}  # insertion-ordered set: this forward's units
        self.phase = Phase.IDLE
        self.pending_reduce_scatters: deque = deque()
        self.peak_transient_unsharded = 0
        self.transient_in_flight: set[Unit] = set()  # kept by unshard/reshard: O(1) to count
        self.host_reads = HostReads(root.groups.device)  # CPU offload with side streams
        # Units a forward with grad left unsharded (the root, the last unit) for its backward;
        # emptied when that backward ends. Still there at the next root forward: that backward
        # never ran, and their gathered values may be stale (the shards may have changed since).
        self.kept_for_backward: list[Unit] = []
        self.post_optim_event = None      # set_post_optim_event: what the next all-gather waits on
        self._reported_idle: set[Unit] = set()  # units named by _report_idle_units
        self.pipelined = False  # finish_reductions ran: forwards run ahead of their backwards

    @classmethod
    def create_standalone(cls, unit: Unit) -> "Schedule":
        """A schedule of `unit` alone, for an explicit unshard() before any forward: the root's
        schedule replaces it at the first forward."""
        schedule = cls(unit, [unit], standalone=True)
        unit.join(schedule, unit.member_names, is_root=False)
        return schedule

    @classmethod
    def create(cls, root: Unit) -> "Schedule":
        if len(root.members) > 1:
            raise NotImplementedError(
                f"fully_shard([...]) of {root.type_name} ran forward before any module containing "
                "them: a list of modules cannot be the root; apply fully_shard to the model that "
                "contains them too (after the list, as torch's fully_shard is applied bottom-up)")
        paths = units_with_paths(root.module)
        for unit, names in paths.items():
            if unit.schedule is not None and not unit.schedule.standalone:
                raise RuntimeError(
                    f"unit '{unit_name(names)}' already ran forward under another root; apply "
                    "fully_shard to every submodule before the first forward of the model")
        units = list(paths)
        if root.groups.single_process:
            warnings.warn(SINGLE_PROCESS, stacklevel=2)
        schedule = cls(root, units)
        for unit, names in paths.items():
            unit.join(schedule, names, is_root=unit is root)
        return schedule

    # ---- forward ------------------------------------------------------------------------------------
    def root_pre_forward(self) -> None:
        if self.phase is Phase.BACKWARD:  # the last backward raised before its end callback
            self.abandon_backward()
        self.drain_reduce_scatters()
        if self.host_reads.work:  # the drain left offloaded gradients to accumulate on the host
            self.host_reads.sync()
        for unit in self.kept_for_backward:  # by a forward whose backward never ran
            unit.reshard()
        self.kept_for_backward = []
        for unit in self.units:  # users edit models between steps: check before any collective
            unit.start_step()
        self.checker.next_iteration(micro_batches_in_flight=self.pipelined)
        streams.iteration_started(self, self.checker.step)
        if not self.streams.side:
            self.post_optim_event = None  # no stream to order: the optimizer step already ended
        self._recording = {}
        move(self, "phase", Phase.FORWARD, (Phase.IDLE, Phase.FORWARD),  # (FORWARD: it raised)
             "the root's pre-forward")

    def record_forward(self, unit: Unit) -> None:
        self._recording.setdefault(unit)  # first use only: a unit used twice keeps its first place

    def root_post_forward(self) -> None:
        self._forward_ended("the root's post-forward")
        for unit in self.units:  # list units some of whose members did not run
            unit.finish_forward()
        if self._recording:
            self.forward_order = list(self._recording)
            self._position = {unit: i for i, unit in enumerate(self.forward_order)}
        if not torch.is_grad_enabled():
            self.reshard_all()
            self._end_of_step_sync()  # no backward follows: the next host write may come now
        else:
            self.kept_for_backward = [u for u in self.units if u.params.gathered()]

    def is_last_in_forward(self, unit: Unit) -> bool:
        return bool(self.forward_order) and self.forward_order[-1] is unit

    def prefetch_forward(self, unit: Unit) -> None:
        if unit.forward_prefetch_units is not None:  # set_modules_to_forward_prefetch
            self._prefetch(unit.forward_prefetch_units, explicit=True)
            return
        depth = self.options.forward_prefetch
        index = self._position.get(unit)
        if depth > 0 and index is not None:
            self._prefetch(self.forward_order[index + 1:index + 1 + depth])

    # ---- backward -----------------------------------------------------------------------------------
    def in_backward(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def in_forward(self) -> bool:
        return self.phase is Phase.FORWARD

    def running(self) -> bool:
        """Inside the root's forward or a backward."""
        return self.phase is not Phase.IDLE

    def where(self, prefetch: bool) -> str:
        """Where an all-gather is issued from, for its tag's description."""
        where = ("backward" if self.in_backward() else "forward" if self.in_forward
                 else "outside forward/backward")
        return f"{where} prefetch" if prefetch else where

    def _forward_ended(self, what: str) -> None:
        if self.phase is Phase.FORWARD:  # (a backward started inside it stays BACKWARD)
            move(self, "phase", Phase.IDLE, (Phase.FORWARD,), what)

    def backward_started(self) -> None:
        if self.phase is not Phase.BACKWARD:
            move(self, "phase", Phase.BACKWARD, (Phase.IDLE, Phase.FORWARD), "the first backward hook")
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize_backward)

    def prefetch_backward(self, unit: Unit, moment: str) -> None:
        # set_modules_to_backward_prefetch; an empty list is no list (torch's default prefetch)
        if unit.backward_prefetch_units:
            if moment == "pre":
                self._prefetch([u for u in unit.backward_prefetch_units if u.unshard_in_backward],
                               explicit=True)
            return
        depth = self.options.backward_prefetch
        index = self._position.get(unit)
        if self.options.backward_prefetch_at == moment and depth > 0 and index is not None:
            self._prefetch([u for u in self.forward_order[max(index - depth, 0):index][::-1]
                            if u.unshard_in_backward])

    def _finish_oldest_reduce_scatters(self, keep: int) -> None:
        while len(self.pending_reduce_scatters) > keep:
            self.pending_reduce_scatters.popleft().finish()

    def make_room_for_reduce_scatter(self) -> None:
        """Finish the oldest pending reduce-scatters before a new one packs its buffer, so that
        with it at most max_pending_reduce_scatters packed buffers exist at a time (the default,
        1: the previous unit's is finished and freed first). That one was issued a unit's
        backward compute ago, so its wait rarely blocks."""
        self._finish_oldest_reduce_scatters(max(self.options.max_pending_reduce_scatters, 1) - 1)

    def add_pending_reduce_scatter(self, record) -> None:
        """`record`: a grads.PendingReduce, finished in issue order."""
        self.pending_reduce_scatters.append(record)
        self._finish_oldest_reduce_scatters(self.options.max_pending_reduce_scatters)

    def drain_reduce_scatters(self) -> None:
        self._finish_oldest_reduce_scatters(0)

    def finalize_backward(self) -> None:
        """Runs once when autograd finishes: flush gradients, free whatever is still unsharded
        (set_is_last_backward(False) leaves the reductions in flight until the next backward's
        end or the next forward; set_reshard_after_backward(False) keeps that unit gathered)."""
        if self.options.is_last_backward:
            self.drain_reduce_scatters()
        reduced = any(unit.requires_gradient_sync and unit.params.grad_indices
                      for unit in self.units)
        self.kept_for_backward = []
        for unit in self.units:
            if unit.reshard_after_backward:
                unit.reshard()
            unit.end_backward()
        move(self, "phase", Phase.IDLE, tuple(Phase), "the end of backward")
        self.checker.backward_finished()
        self._report_idle_units()
        RECORDER.add("backward.finalize", self.root.name)
        # Last, so that a mismatch raises with the units already sharded. A backward that reduced
        # nothing (no_sync micro-batches) precedes no optimizer step: its flags and host reads
        # are waited for with the next one's, once per optimizer step.
        if reduced:
            self._end_of_step_sync()
        else:
            self.checker.defer_flags()

    def finish_reductions(self) -> None:
        """After grads.reduce_accumulated (torch's pipelining): wait, reshard and make the step's
        one host sync, as the end of a reducing backward does."""
        self.pipelined = True
        self.drain_reduce_scatters()
        for unit in self.units:
            if unit.reshard_after_backward:
                unit.reshard()
                unit.params.install_sharded()
        self._end_of_step_sync()

    def _end_of_step_sync(self) -> None:
        """The one host sync of a step: the compute stream is ordered after the offloaded shards'
        reads first, so that the collective tags' flag wait also covers them; the host
        epilogues run once it returned (a sync of their own only without tags on the device)."""
        self.host_reads.order()
        synced = self.checker.read_flags()
        self.host_reads.sync(already_synced=synced)

    def _report_idle_units(self) -> None:
        """Name, once each, the trainable units whose forward did not run in this step: their
        parameters got no gradient. Legitimate for a branch not taken; a mistake when the unit is
        a container whose own forward is never called (its children then run on sharded
        parameters, which their own check reports at the call)."""
        for unit in self.units:
            if unit in self._recording or unit in self._reported_idle:
                continue
            if any(bucket.requires_grad for bucket in unit.buckets):
                self._reported_idle.add(unit)
                warnings.warn(
                    f"fsdp_ext: unit '{unit.name or '<root>'}' ({unit.type_name}) took "
                    "no part in this step (its forward never ran), so its parameters got no "
                    "gradient; said once per unit", stacklevel=2)

    def abandon_backward(self) -> None:
        """Clean up after a backward that raised (a hook, a collective, a non-finite gradient).

        Every rank issued the same collectives, so they are waited for, but the gradients still in
        flight and any no_sync accumulation are dropped: they belong to the failed step, and
        applying them now would land after the user's zero_grad(). The units go back to sharded.
        """
        while self.pending_reduce_scatters:
            self.pending_reduce_scatters.popleft().abandon()
        for unit in self.units:
            unit.params.drop_gradient_state()
        self.finalize_backward()

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: wait for what is in flight, drop the failed
        step's gradients (no_sync and HSDP partial sums included), reshard every unit."""
        for unit in self.units:
            unit.abandon_step()
        self._forward_ended("a reset after a failure")
        self._recording = {}
        self.abandon_backward()

    def forward_failed(self) -> None:
        """A registered method of the root raised: its forward is over."""
        self._forward_ended("a registered method's failure")

    def set_post_optim_event(self, event) -> None:
        self.post_optim_event = event

    def take_post_optim_event(self):
        event, self.post_optim_event = self.post_optim_event, None
        return event

    def reshard_all(self) -> None:
        for unit in self.units:
            unit.reshard()

    # ---- prefetch and the in-flight bound -----------------------------------------------------------
    def transient_unsharded(self) -> int:
        """Units freed between uses that are unsharded or being gathered (their buffers hold
        memory)."""
        return len(self.transient_in_flight)

    def note_unshard(self, unit: Unit) -> None:
        if unit.transient:
            self.transient_in_flight.add(unit)
            self.peak_transient_unsharded = max(self.peak_transient_unsharded,
                                                len(self.transient_in_flight))

    def note_reshard(self, unit: Unit) -> None:
        self.transient_in_flight.discard(unit)

    def _prefetch(self, units: list[Unit], explicit: bool = False) -> None:
        """Issue the all-gathers of `units` (the next ones in execution order, or a list the user
        gave, which may hold more than the depth allows), nearest first."""
        limit = self.max_in_flight()
        if limit is not None and explicit:
            limit = max(limit, len(units) + 1)
        for unit in units:
            if unit.params.gathered():
                continue
            if limit is not None and unit.transient and self.transient_unsharded() >= limit:
                RECORDER.add("prefetch.skipped", unit.name)
                break
            unit.unshard(prefetch=True)

    def max_in_flight(self) -> int | None:
        if not self.options.limit_in_flight:
            return None
        return max(self.options.forward_prefetch, self.options.backward_prefetch) + 1
