"""Collectives over torch.distributed and the process groups a unit talks to (those the runtime
creates: process_groups.py).

Overlap works the same way on both device kinds, with one small record per collective that holds
the tensors it reads and writes until someone waits on it (no `record_stream`):
  * accelerators (CUDA/NCCL): the collective runs on a side stream after that stream waited for
    the compute stream; an event marks its end, and the consumer's stream waits on that event
    before the record lets go of the tensors (streams.py, "[Note: stream order and buffer
    lifetime]").
  * CPU/gloo: the collective is issued with `async_op=True`; gloo runs it on its own thread, and
    waiting on the work handle is the synchronisation. A unit's all-gather (copy-in and issue) is
    moreover queued on the issue thread (csrc/cpu/issue_thread.cpp), the CPU counterpart of the
    all-gather stream, so that neither costs the compute thread.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from ... import ops
from ..core import streams
from ..core.errors import CollectiveError
from .groups import Groups  # noqa: F401  (comm.Groups: who a unit talks to)

if ops.HAVE_EXTENSION:
    from ... import _C
    # Everything queued is issued before the interpreter finalizes (the thread holds tensors).
    atexit.register(_C.drain_issue_thread)

DEFAULT_TIMEOUT_S = 300.0


class DefaultTimeout(datetime.timedelta):
    """The default bound (nobody set one), told apart from a value the user chose: the meet
    before a process group's creation, which comes before a model's first collective (a rank
    may still be loading a checkpoint or a dataset index alone), waits the process group's own
    timeout instead, as torch's first collective would (process_groups.meet)."""


def collective_timeout(seconds: float | datetime.timedelta | None = None,
                       environment: str | None = None) -> datetime.timedelta | None:
    """How long a wait on one of our collectives may block: the argument, else `environment`
    (FSDP_EXT_COLLECTIVE_TIMEOUT_S as fsdp_ext/env.py read it), else 300 s (a DefaultTimeout; well under
    the process group's own timeout: 30 min for gloo, 10 min for NCCL, so that the runtime,
    which knows the units and the other ranks' progress, reports first). A peer that stopped
    issuing collectives (stuck, dead, or in a different branch) becomes a CollectiveError naming
    it. 0 or "none": no bound but the process group's."""
    if seconds is None and not environment:
        return DefaultTimeout(seconds=DEFAULT_TIMEOUT_S)
    if seconds is None:
        seconds = environment
    if isinstance(seconds, str) and seconds.lower() == "none":
        return None
    if isinstance(seconds, datetime.timedelta):
        return seconds
    return datetime.timedelta(seconds=float(seconds)) if float(seconds) > 0 else None


def wait_work(work, timeout: datetime.timedelta | None) -> None:
    """work.wait(), bounded by `timeout` (gloo raises "Operation timed out!" when it expires)."""
    work.wait() if timeout is None else work.wait(timeout)


def issue_all_gather(fulls: list[torch.Tensor], sources: list[torch.Tensor], slot: int,
                     group: dist.ProcessGroup | None, label: str,
                     timeout: datetime.timedelta | None, tags: list = ()) -> "Pending":
    """Queue on the issue thread: copy each source into slot `slot` of its (filled) flat buffer
    (unless it is that slot: bytes written in place), then gather the other slots over `group`
    (process_groups.issue_thread_group) by one broadcast per rank. `tags`: the collectives'
    tags, already exchanged, checked at the wait."""
    job = _C.issue_all_gather(fulls, sources, slot, group)  # holds the tensors until waited
    return Pending(label=label, timeout=timeout, job=job, tags=list(tags))


@dataclass
class Pending:
    """Collectives in flight and everything they touch; `wait()` makes their results usable."""

    works: list = field(default_factory=list)
    event: object = None                              # a side stream's event (streams.py)
    device: torch.device | None = None                # whose current stream waits on `event`
    keep_alive: list[torch.Tensor] = field(default_factory=list)
    label: str = ""                                   # e.g. "all_gather of unit 'blocks.0'"
    timeout: datetime.timedelta | None = None         # see collective_timeout()
    job: object = None                                # queued on the issue thread (_C._IssuedGather)
    tags: list = field(default_factory=list)          # CollectiveCheck: checked at the wait

    def hold(self, *tensors: torch.Tensor | None) -> None:
        """Keep `tensors` alive until the collectives are waited for."""
        self.keep_alive.extend(t for t in tensors if t is not None)

    def wait(self) -> None:
        """Make the results usable by the current stream of `device` (CPU: by the host). The
        collectives' tags are checked here: on the host first (CPU ranks: a divergent rank raises
        before any of the data is used), or on the device after the stream wait (read once per
        step: collective_tags.py, [Note: checking on the device])."""
        tags, self.tags = self.tags, []
        for tag in tags:
            tag.before_wait(self.timeout)
        if tags:  # the last one names the collective this wait finishes (the heartbeat says so)
            with tags[-1].waiting():
                self._wait_works(tags[-1])
        else:
            self._wait_works(None)
        self.works = []
        if self.event is not None:
            # The waiting stream is ordered after the collective before its tensors are let go:
            # a block freed now is reused only by work that runs after the collective.
            streams.wait_event(streams.current_stream(self.device), self.event)
            self.event = None
        for tag in tags:  # now ordered after the exchange: compared on the device, read per step
            tag.after_wait()
        self.keep_alive.clear()

    def _wait_works(self, last: "CollectiveCheck | None") -> None:
        """The host's wait for the collectives: a failure names the collective (and, through its
        last tag, the ranks that stopped, and where they last were)."""
        try:
            if self.job is not None:  # issued and waited for in one call, without the GIL
                job, self.job = self.job, None
                job.wait(self.timeout.total_seconds() if self.timeout is not None else None)
            for work in self.works:
                wait_work(work, self.timeout)
        except Exception as exc:  # a dead peer or a timeout: say which collective it was
            if last is not None:
                last.on_failure(exc, self.timeout)
            rank = dist.get_rank() if dist.is_initialized() else 0
            bound = f" (collective_timeout {self.timeout.total_seconds():g} s)" if self.timeout else ""
            raise CollectiveError(
                f"rank {rank}: {self.label or 'a collective'} failed{bound}: {exc}") from exc


class CollectiveCheck(Protocol):
    """What comm asks of a collective's tag (collective_tags.Tag), and all it knows of it."""

    def exchange(self) -> "CollectiveCheck":
        """Start it, on the current stream, right before its data collective."""

    def before_wait(self, timeout: datetime.timedelta | None) -> None:
        """Before the host waits for the data (checked on the host: here, in issue order)."""

    def waiting(self) -> contextlib.AbstractContextManager:
        """A context in which this rank is blocked on the collective (the peer watch's)."""

    def on_failure(self, exc: Exception, timeout: datetime.timedelta | None) -> None:
        """The wait for the data failed: raise CollectiveError naming the ranks that stopped."""

    def after_wait(self) -> None:
        """The current stream was ordered after the data (checked on the device: here)."""


class Streams:
    """Side streams for collectives on accelerators; on CPU, the issue thread for all-gathers."""

    def __init__(self, device: torch.device, timeout: datetime.timedelta | None = None,
                 issue_thread: bool = True):
        """`issue_thread`: CPU all-gathers go through the issue thread (False, as with
        FSDP_EXT_ISSUE_THREAD=0, or without the compiled extension: the compute thread's)."""
        self.device = device
        self.side = streams.side_streams(device)
        self.timeout = timeout
        self.issue_thread = not self.side and issue_thread and ops.HAVE_EXTENSION
        if self.side:
            # High priority: a delayed collective delays every unit behind it.
            self.all_gather = streams.new_stream(device, priority=-1, name="all_gather")
            self.reduce_scatter = streams.new_stream(device, priority=-1, name="reduce_scatter")

    def launch(self, stream_name: str, fn, keep_alive: list[torch.Tensor], label: str = "",
               after_event=None, tags=None) -> Pending:
        """Run `fn(async_op) -> list of work handles` as collectives in flight; return their record.

        With side streams `fn` runs on the side stream (allocations included) after that stream
        waited for the compute stream, so it sees every earlier write and may reuse memory freed
        before this call. `keep_alive` holds whatever `fn` reads or writes that another stream
        allocated, until the record is waited on. `after_event` (FSDPModule.set_post_optim_event):
        the side stream waits for that event instead of the whole compute stream. `tags()` makes
        the collectives' tags (CollectiveCheck, or None where a collective has none), exchanged
        right before `fn`, on the same stream.
        """
        if not self.side:
            issued = _make_tags(tags)
            for tag in issued:
                tag.exchange()
            try:
                works = [w for w in fn(True) if w is not None]
            except Exception as exc:
                raise CollectiveError(f"rank {dist.get_rank()}: {label} failed: {exc}") from exc
            return Pending(works=works, keep_alive=keep_alive, label=label, timeout=self.timeout,
                           tags=issued)
        stream = getattr(self, stream_name)
        if after_event is not None:
            streams.wait_event(stream, after_event)
        else:
            streams.wait_stream(stream, streams.current_stream(self.device))
        with streams.use_stream(stream):
            # Made on the stream that writes them, after its wait: with `after_event` that stream
            # is not ordered after the compute stream's latest work, so memory the compute stream
            # allocated now could still be in use by it (the caching allocator recycles a block
            # as soon as the compute stream queued its last use).
            issued = _make_tags(tags)
            streams.inject_delay(stream)
            for tag in issued:
                tag.exchange()
            fn(False)
            event = streams.record_event(stream)
        return Pending(event=event, device=self.device, keep_alive=keep_alive, label=label,
                       timeout=self.timeout, tags=issued)


def _make_tags(tags) -> list[CollectiveCheck]:
    return [t for t in (tags() if tags is not None else ()) if t is not None]


# torch 2.14 renamed the flat-tensor collectives; older releases only have the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    """Gather every rank's `input` into `output` (rank r's chunk at r * input.numel())."""
    if output.device.type == "cpu":
        return _all_gather_by_broadcasts(output, input, group, async_op)
    return all_gather_flat(output, input, group=group, async_op=async_op)


class _Works:
    """Work handles that finish one collective, waited on as one; then, once, `finish()` on its
    result. What `keep` holds (the collective's input) lives until then."""

    def __init__(self, works: list, finish=None, keep=None):
        self.works, self._finish, self._keep = works, finish, keep

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        works, self.works = self.works, []
        for work in works:
            wait_work(work, timeout)
        if self._finish is not None:
            finish, self._finish, self._keep = self._finish, None, None
            finish()
        return True


def all_to_all_then(output: torch.Tensor, input: torch.Tensor, group, async_op: bool, finish):
    """Rank r receives every rank's chunk r of `input` into `output` (equal chunks), then
    `finish()` runs on the result: at the returned handle's wait (async_op), or before this
    returns (None)."""
    work = _Works([dist.all_to_all_single(output, input, group=group, async_op=True)], finish,
                  input)
    if async_op:
        return work
    work.wait()
    return None


def _all_gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    """gloo's all-gather (all_gather_into_tensor) receives into a temporary buffer of the full
    output size and copies it out when done: a second unit-sized allocation held while the gather
    is in flight, plus a copy of every byte. One broadcast per rank, each of that rank's chunk in
    place inside `output`, moves the same bytes with neither (2-4x faster for unit-sized buffers
    with 2 and 4 ranks on loopback)."""
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = output.view(-1)
    chunk = flat.numel() // world
    mine = flat.narrow(0, rank * chunk, chunk)
    if input.data_ptr() != mine.data_ptr():
        mine.copy_(input.reshape(-1))
    sources = dist.get_process_group_ranks(group)
    works = _Works([dist.broadcast(flat.narrow(0, r * chunk, chunk), src=sources[r], group=group,
                                   async_op=True) for r in range(world)])
    if async_op:
        return works
    works.wait()
    return None


def reduce_scatter_sum(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    return _reduce_scatter_flat(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def reduce_scatter_groups(flat: torch.Tensor, layout, group, async_op: bool,
                          sent: list[int] | None = None):
    """Sum `flat` (W * S elements: each gather group's block at W * shard_offset, rank-major, see
    layout.py) over `group`; return this rank's region of every group (of the groups `sent`
    only, if given) and the work handles.

    gloo (every CPU tensor) has no native reduce-scatter: reduce_scatter_tensor clones its input,
    all-reduces the clone and copies the rank's chunk out when waited on. An all-reduce in place on
    the packed buffer (ours, read by nobody else) moves the same bytes without the clone, the copy
    or the output tensor; the rank's slices of it are the result.
    """
    world, rank = layout.world_size, layout.rank
    groups = layout.groups if sent is None else [layout.groups[i] for i in sent]
    if group is None:  # one rank: the packed buffer is the result
        return [flat.narrow(0, g.shard_offset, g.shard_numel) for g in groups], []
    if flat.device.type == "cpu":
        blocks = [flat] if sent is None else [
            flat.narrow(0, world * g.shard_offset, world * g.shard_numel) for g in groups]
        works = [dist.all_reduce(b, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
                 for b in blocks]
        return [flat.narrow(0, world * g.shard_offset + rank * g.shard_numel, g.shard_numel)
                for g in groups], works
    reduced = torch.empty(layout.shard_numel, dtype=flat.dtype, device=flat.device)
    pieces, works = [], []
    for g in groups:
        piece = reduced.narrow(0, g.shard_offset, g.shard_numel)
        block = flat.narrow(0, world * g.shard_offset, world * g.shard_numel)
        works.append(reduce_scatter_sum(piece, block, group, async_op))
        pieces.append(piece)
    return pieces, works


def all_reduce_sum(tensor: torch.Tensor, group, async_op: bool):
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
