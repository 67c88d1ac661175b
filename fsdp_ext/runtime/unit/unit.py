"""One unit: the parameters of one `fully_shard` call, their buckets and the hooks that move them.

The timeline of a unit in one training step (see README, "How it works"), in the order of this
file:

    pre_forward:   unshard (all-gather every bucket into its gathered buffer), parameters -> views
    post_forward:  parameters -> shard views again; free the buffers unless kept for backward
    pre_backward:  (a hook on the forward outputs) unshard again if it was freed
    post_backward: (the backward of the views) pack + reduce-scatter the gradients, free buffers

What it moves is owned elsewhere: the buffers, the all-gather in flight and what the modules hold
by unit_params.py (gathered by gather.py, the gradients reduced by grads.py), the states by
unit_state.py (every transition checked there); the user-facing checks are unit_checks.py, the
adoption of new parameter tensors adopt.py; what happens to it between steps and outside them
(joining its root, a step's start and end, resets, registered methods, summon_full_params) is
unit_lifecycle.py; list units (`fully_shard([m1, m2])`) are list_unit.py, registered forward
methods forward_methods.py.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..bucket import gather
from . import checks as unit_checks
from ..bucket.adopt import adopt_params
from ..bucket.grads import reduce_bucket
from ..core.mixed_precision import cast_floating
from ..bucket.param_buckets import build_unit_buckets
from .schedule import Schedule
from ..core.trace import RECORDER, begin_range, end_range, profiler_range, span
from .config import UnitConfig
from .lifecycle import UnitLifecycle
from .settings import UnitSettings
from .params import UnitParams
from .states import (BACKWARD_STATES, Installed, ShardedState, TrainingState, backward_from,
                     move, pre_forward_from)


class Unit(UnitLifecycle, UnitSettings):
    """`module` is one module, or a list of modules sharded together (torch's
    `fully_shard([m1, m2])`: one all-gather and one reduce-scatter for all of them; the
    pre-forward runs at the first of them to run, the post-forward once all of them ran);
    `config` is what it is built with (unit_config.py)."""

    def __init__(self, module: nn.Module | list[nn.Module], config: UnitConfig):
        self.members = list(module) if isinstance(module, (list, tuple)) else [module]
        self.module = self.members[0]    # the unit's module (a list's first)
        self.config = config
        self.groups, self.mp, self.offload = config.groups, config.mp, config.offload
        self.options = config.schedule   # the schedule's if it becomes the root (schedule_options)
        self._init_settings(config.reshard_after_forward)  # torch FSDPModule's set_* knobs
        self.name = ""                   # fully qualified name, set by the root at lazy init
        self.member_names = [""] * len(self.members)  # each member's, likewise
        self.schedule: Schedule | None = None
        self.is_root = False
        self.training_state = TrainingState.IDLE
        self.method_depth = 0                # inside a register_fsdp_forward_method method
        self.mesh, self.buckets = build_unit_buckets(self.members, config)
        self.params = UnitParams(self.name, self.buckets, self.groups.device,
                                 self.mp.param_dtype, self.offload)
        for bucket in self.buckets:  # (what a subclass bucket's hooks are called with)
            bucket.wire.bind_unit(bucket, self.mesh, self.mp, self.offload,
                                  self.groups.post_forward_size, self.type_name)
        # The hooks run eagerly under torch.compile (a graph break at each unit boundary, as
        # torch's FSDP2 skips its hooks): they issue collectives and resize storages, which
        # graphs with dynamic shapes cannot hold, and they decide per step what to gather.
        pre, post = self._forward_hooks()
        self._handles = [handle for member in self.members for handle in (
            member.register_forward_pre_hook(torch.compiler.disable(pre), prepend=True,
                                             with_kwargs=True),
            member.register_forward_hook(torch.compiler.disable(post), with_kwargs=True))]
        # Submodules holding this unit's parameters say so when called while they are sharded
        # (outside the unit's forward), instead of failing with a shape error deep in torch.
        # A compiled block traces these hooks: there the check is skipped (is_compiling() is
        # constant in a trace) rather than a graph break, which fullgraph=True refuses.
        holders = {id(m): m for b in self.buckets for s in b.slots for m, _ in s.locations}
        check = torch.compiler.disable(self._check_params_gathered)

        def check_unless_traced(module, args):
            if not torch.compiler.is_compiling():
                check(module, args)
        self._handles += [m.register_forward_pre_hook(check_unless_traced)
                          for m in holders.values()
                          if not any(m is member for member in self.members)]

    def _forward_hooks(self):
        return self._pre_forward, self._post_forward

    # ---- what it is -------------------------------------------------------------------------------
    @property
    def reshards_after_forward(self) -> bool:
        if self.reshard_after_forward is None:
            return not self.is_root
        return bool(self.reshard_after_forward)

    @property
    def transient(self) -> bool:
        """Freed between uses, so it counts towards the in-flight bound."""
        return self.reshards_after_forward

    @property
    def unsharded(self) -> bool:
        return self.params.sharded_state is ShardedState.UNSHARDED

    def holds_unsharded_memory(self) -> bool:
        return self.params.holds_unsharded_memory()

    def param_name(self, slot) -> str:
        """A parameter's name in the model (known once the root has named the units)."""
        prefix = self.member_names[slot.member]
        return f"{prefix}.{slot.fqn}" if prefix else slot.fqn

    @property
    def type_name(self) -> str:
        """The class name of the unit's module (of each module, for a list), for messages."""
        return "+".join(type(m).__name__.removeprefix("FSDP") for m in self.members)

    def _check_params_gathered(self, module, args) -> None:
        unit_checks.check_params_gathered(self, module)

    def adopt_params(self) -> None:
        adopt_params(self)

    # ---- unshard / reshard ------------------------------------------------------------------------
    def unshard(self, async_op: bool = True, *, prefetch: bool = False) -> None:
        """Issue the all-gathers of every bucket (unless unsharded or already in flight); with
        `async_op=False` wait for them too. `prefetch`: the schedule issues them ahead of their
        use (their tags say so)."""
        if not self.params.gathered():
            self._start_unshard(prefetch)
        if not async_op:
            self.wait_unshard()

    def _start_unshard(self, prefetch: bool = False) -> None:
        chunks = self.params.take_chunks()
        if not self.buckets:  # every parameter belongs to child units: nothing to gather or wait for
            self.params.started_unshard(None)
            return
        unit_checks.check_materialized(self)
        schedule = self.schedule or Schedule.create_standalone(self)  # unshard() before forward
        after_event = schedule.take_post_optim_event() if self.is_root else None
        # Without a shard group (NO_SHARD, one rank) the unshard is a local copy: the trace says
        # so instead of showing an all-gather that does not happen.
        kind = "all_gather" if self.groups.shard is not None else "unshard_copy"
        RECORDER.add(f"{kind}.issue", self.name)
        in_flights = []
        with profiler_range(kind, self.name):
            for buckets, group, slot, world in self._gathers(chunks is not None):
                sizes = [(bucket.full_numel, bucket.full.dtype) for bucket in buckets]

                def tags(group=group, sizes=sizes):
                    return [schedule.checker.issue(group, "all_gather", self.name, sizes,
                                                   schedule.where(prefetch))]
                in_flights.append(gather.start(
                    buckets, chunks and [chunks[self.buckets.index(b)] for b in buckets], group,
                    slot, world, schedule.streams,
                    offload=self.offload is not None and chunks is None,
                    label=f"{kind} of unit '{self.name or '<root>'}'", name=self.name,
                    tags=tags, after_event=after_event))
        in_flight = in_flights[0] if len(in_flights) == 1 else gather.InFlightGathers(in_flights)
        self.params.started_unshard(in_flight)
        if self.offload is not None and chunks is None:  # it reads the host shards
            schedule.host_reads.note_read(in_flight.event)
        RECORDER.add(f"{kind}.issued", self.name)  # launched: collective queued
        schedule.note_unshard(self)

    def _gathers(self, regather: bool) -> list[tuple[list, object, int, int]]:
        """(buckets, group, this rank's slot, world) per all-gather: one over the unit's shard
        group (or, regathering from post-forward chunks, its post-forward group), one more per
        mesh some of its parameters have of their own (placements.py)."""
        by_groups: dict[int, tuple[list, object, int, int]] = {}
        for bucket in self.buckets:
            on = bucket.groups
            if regather:
                group, slot, world = on.post_forward, on.post_forward_rank, on.shard_size
            else:
                group, slot, world = on.shard, on.shard_rank, on.shard_size
            by_groups.setdefault(id(on), ([], group, slot, world))[0].append(bucket)
        return list(by_groups.values())

    def wait_unshard(self) -> None:
        in_flight = self.params.in_flight
        if in_flight is not None:
            with span(f"{in_flight.kind}.wait", self.name):
                self.params.finish_unshard()

    def every_groups(self) -> list:
        """The unit's groups, then each bucket's (its own mesh's where it has one)."""
        return [self.groups, *(b.groups for b in self.buckets)]

    def reshard(self) -> None:
        """Free the unsharded buffers (after any all-gather into them finished) and give the
        modules their sharded parameters back."""
        self.wait_unshard()
        if self.params.installed is Installed.UNSHARDED:  # (summon's full copies stay)
            self.params.install_sharded()
        if not self.unsharded:
            return
        k = self.groups.post_forward_size
        keep = (k > 1 and self.groups.post_forward is not None and self.schedule.in_forward
                and torch.is_grad_enabled())
        # reshard_after_forward=k: keep 1/k of the unit for a cheaper regather
        self.params.free(keep)
        self.schedule.note_reshard(self)
        RECORDER.add("reshard", self.name)

    # ---- forward ----------------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        schedule = self.schedule
        if schedule is None or schedule.standalone:
            schedule = Schedule.create(self)
        if schedule.in_backward():  # recomputation (activation checkpointing) inside backward
            self.unshard(async_op=False)
            self.params.install_unsharded(self)
            return cast_floating((args, kwargs), self._input_dtype())
        if self.is_root and not self.method_depth:  # not nested in a registered method
            schedule.root_pre_forward()
        if self.training_state is TrainingState.SUMMONED:  # the module holds the full parameters
            return cast_floating((args, kwargs), self._input_dtype())
        move(self, "training_state", TrainingState.FORWARD,
             pre_forward_from(bool(self.method_depth), self.pass_open), "pre-forward")
        schedule.record_forward(self)
        RECORDER.add("forward.begin", self.name)
        self.unshard()
        self.wait_unshard()
        self.params.install_unsharded(self)
        args_kwargs = cast_floating((args, kwargs), self._input_dtype())
        # Last, so that this thread's work above is done before the next unit's all-gather
        # starts to compete with it for the cores (gloo moves the bytes with CPU time).
        schedule.prefetch_forward(self)
        begin_range("forward", self)  # compute only: the all-gather wait is its own range
        return args_kwargs

    def _post_forward(self, module, args, kwargs, output):
        schedule = self.schedule
        if self.method_depth:  # forward called inside a registered method: it still runs
            return self._post_forward_nested(output)
        if self.training_state is TrainingState.SUMMONED:
            if self.is_root:
                schedule.root_post_forward()
            return cast_floating(output, self.mp.output_dtype)
        self.params.install_sharded()
        if schedule.in_backward():  # the end of a recomputation
            return None
        move(self, "training_state", TrainingState.IDLE, (TrainingState.FORWARD,),
             "post-forward")
        end_range("forward", self)
        RECORDER.add("forward.end", self.name)
        output = cast_floating(output, self.mp.output_dtype)
        if torch.is_grad_enabled():
            hooked = self._register_pre_backward(output)
            needs_params = any(b.requires_grad for b in self.buckets)
            if self.reshards_after_forward and not schedule.is_last_in_forward(self) and (
                    hooked or not needs_params):
                self.reshard()
        else:
            self.reshard()  # no backward follows: free even the root
        if self.is_root:
            schedule.root_post_forward()
        return output

    def finish_forward(self) -> None:
        """The root's forward ended (list units: ListUnit's, for members that did not run)."""

    def _post_forward_nested(self, output):
        """The module's forward ended inside one of its registered methods (e.g. generate()
        calling forward): the parameters stay gathered for the rest of the method."""
        end_range("forward", self)
        output = cast_floating(output, self.mp.output_dtype)
        if torch.is_grad_enabled():
            self._register_pre_backward(output)
        return output

    @property
    def pass_open(self) -> bool:
        """Whether some of the unit's modules ran this forward and others are yet to (a list
        unit's; one module runs whole)."""
        return False

    def members_running(self) -> set | None:
        """The indices of the members run in the open forward pass (None: one module)."""
        return None

    def _input_dtype(self):
        return self.mp.param_dtype if self.mp.cast_forward_inputs else None

    # ---- backward ---------------------------------------------------------------------------------
    def _register_pre_backward(self, output) -> bool:
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        for t in tensors:
            t.register_hook(self._pre_backward)
        return bool(tensors)

    def _pre_backward(self, grad):
        schedule = self.schedule
        schedule.backward_started()
        if self.training_state not in BACKWARD_STATES:
            RECORDER.add("backward.begin", self.name)
        move(self, "training_state", TrainingState.PRE_BACKWARD, backward_from(self.pass_open),
             "pre-backward")
        if self.params.held is not None and not self.params.uses.will_run():  # an input pass
            self.params.flush_held(self)  # (params.UnitParams.hold_weight_pass)
        if not self.unshard_in_backward:  # set_unshard_in_backward(False): no parameter needed
            schedule.prefetch_backward(self, "pre")
            begin_range("backward", self)
            return None
        self.unshard()
        self.wait_unshard()
        # A recomputation that calls the module's `forward` without its hooks (transformers'
        # gradient checkpointing wraps `forward`, not `__call__`) reads the module's attributes:
        # they must be the gathered parameters, tracked as in forward so that it saves the same
        # tensors (and, when reentrant, sends the parameters' gradients to post_backward).
        with torch.enable_grad():
            self.params.install_unsharded(self)
        schedule.prefetch_backward(self, "pre")
        begin_range("backward", self)
        return None

    def post_backward(self, arrived) -> None:
        """One backward use ran (its gradients summed with the earlier uses' of this backward; None
        while a later use is still to run: backward_uses.py): free the unit, reduce each trainable
        bucket."""
        move(self, "training_state", TrainingState.POST_BACKWARD, backward_from(self.pass_open),
             "post-backward")
        end_range("backward", self)
        RECORDER.add("backward.end", self.name)
        # Free the gathered parameters before the gradient path allocates its packed buffers:
        # the gradients are computed, nothing reads the parameters again in this use.
        if self.reshard_after_backward:
            self.reshard()
        self.params.install_sharded()
        if arrived is not None:
            grads, ran = iter(arrived.grads), arrived.ran
            for bucket in (self.buckets[i] for i in self.params.grad_indices):
                reduce_bucket(self, bucket, [next(grads) for _ in bucket.slots],
                              None if ran is None else [s.member in ran for s in bucket.slots])
        self.schedule.prefetch_backward(self, "post")


def ensure_root(unit: Unit) -> None:
    """Make `unit` the root of its units now, as its first forward would (FSDP1's lazy init on
    summon_full_params): a method then called inside the summon (generate() calling the encoder,
    then forward) finds the root's schedule instead of making a sub-unit a root of its own."""
    if unit.schedule is None or unit.schedule.standalone:
        Schedule.create(unit)
