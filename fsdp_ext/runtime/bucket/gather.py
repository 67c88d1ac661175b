"""The all-gather of one bucket, group by group (layout.py, [Note: gather groups]).

    targets:   per group, the W * Q buffer its collective fills: a slice of the gathered buffer
               (direct group), or a staging buffer (copied group)
    copy-in:   this rank's region of the source (its shard, or a post-forward chunk) cast into its
               slot of each target
    collective per group (an in-place all-gather)
    copy-out:  copied groups' staging unpacked into each parameter's place, one launch; staging freed

`start` is the unit's one all-gather path, for every wire format (wire/), behind the streams
seam: on CPU the copy-in and the collectives run on the issue thread (comm.issue_all_gather), with
side streams on the all-gather stream (comm.Streams.launch), else on the calling thread;
`InFlightGather.finish` waits and lets each bucket's wire format finish (copy-out, dequantize,
post-hooks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import ops
from ..comm import collectives as comm, process_groups
from ..wire import exact as wire
from .bucket import Bucket
from ..core.offload import to_compute_device
from ..core.trace import profiler_range


@dataclass(eq=False)
class InFlightGather:
    """One unshard from its launch to `finish()`: the collectives, and what each bucket's wire
    format finishes once they are done (None once finished, or when stream order finished it)."""

    pending: comm.Pending
    kind: str                                   # "all_gather", or "unshard_copy" (no group)
    to_finish: list | None = None               # per bucket, GatherBuffers.done
    buckets: list = field(default_factory=list)
    name: str = ""                              # the unit's, for the profiler

    @property
    def event(self):
        """Recorded on the all-gather stream once its copies are issued."""
        return self.pending.event

    def finish(self) -> None:
        self.pending.wait()
        to_finish, self.to_finish = self.to_finish, None
        if to_finish is not None:
            _finish_all(self.buckets, to_finish, self.name)


class InFlightGathers:
    """A unit's all-gathers over several meshes (placements.py), finished as one."""

    def __init__(self, parts: list[InFlightGather]):
        self.parts, self.kind = parts, parts[0].kind

    @property
    def event(self):
        """The last part's: issued last on the same stream, it follows every part's copies."""
        return self.parts[-1].event

    def finish(self) -> None:
        for part in self.parts:
            part.finish()


def start(buckets: list[Bucket], chunks, group, slot: int, world: int, streams_: comm.Streams, *,
          offload: bool, label: str, name: str, tags, after_event=None) -> InFlightGather:
    """Gather every bucket into its gathered buffer: this rank's shard, or its post-forward
    `chunks`, goes into `slot`; `group` None is a local copy. What goes on the wire is each
    bucket's wire format's (wire/); the path is the same for all. `tags()` makes the
    collectives' tags (collective_tags.py), exchanged on the collectives' own order."""
    kind = "all_gather" if group is not None else "unshard_copy"
    if streams_.issue_thread:  # CPU: copy-in and broadcasts off this thread
        # Host shards are read in place. A wire format that writes its bytes itself (quantized,
        # tensor subclass) has filled this rank's slot here; the issue thread's copy skips it.
        sent = [_buffers(bucket, chunks, i, world, slot, group, offload=False)
                for i, bucket in enumerate(buckets)]
        # The tag goes on `group`, issued by this thread; the data on the issue thread's own
        # group: each group's collectives keep one order on every rank.
        issued = [t.exchange() for t in tags() if t is not None]
        pending = comm.issue_all_gather(
            [t for b in sent for t in b.targets], [t for b in sent for t in b.sources], slot,
            process_groups.issue_thread_group(group), label, streams_.timeout, tags=issued)
        return InFlightGather(pending, kind, [b.done for b in sent], buckets, name)

    record = InFlightGather(None, kind, buckets=buckets, name=name)

    def fill_and_gather(async_op: bool) -> list:
        """(Side streams: on the all-gather stream, allocations included.) Finish at once when
        the collectives are synchronous; else at `finish()`."""
        works, done = [], []
        for i, bucket in enumerate(buckets):
            sent = _buffers(bucket, chunks, i, world, slot, group, offload)
            done.append(sent.done)
            with profiler_range("copy_in", name):
                works += wire.copy_in_and_gather(sent.targets, sent.sources, slot, group,
                                                 async_op)
        if async_op:
            record.to_finish = done
        else:
            _finish_all(buckets, done, name)
        return works

    # With side streams the copy-in reads the post-forward chunks (allocated by the compute
    # stream) on the all-gather stream: they are held until it is waited for.
    record.pending = streams_.launch(
        "all_gather", fill_and_gather, keep_alive=[c for cs in chunks or () for c in cs],
        label=label, after_event=after_event, tags=tags)
    return record


def _buffers(bucket: Bucket, chunks, index: int, world: int, slot: int, group,
             offload: bool) -> wire.GatherBuffers:
    """Give the bucket's gathered buffer its storage; what its wire format sends: this rank's
    post-forward chunk, or its shard (copied to the device if offloaded)."""
    bucket.start_fill()
    full = bucket.full_data
    shard = bucket.shard
    if offload and chunks is None:
        shard = to_compute_device(shard, full.device)
    return bucket.wire.gather_buffers(bucket, full, chunks[index] if chunks is not None else None,
                                      slot, world, group, shard)


def _finish_all(buckets, done: list, name: str) -> None:
    with profiler_range("copy_out", name):
        for bucket, bucket_done in zip(buckets, done):
            bucket.wire.finish_gather(bucket, bucket.full_data, bucket_done)


def post_forward_chunks(bucket: Bucket, full: torch.Tensor, world: int, k: int,
                        index: int) -> list[torch.Tensor]:
    """reshard_after_forward=k: what this rank keeps after forward so that backward regathers
    from k ranks. The member `index` of each group of k consecutive ranks keeps part `index` of
    every group's rank-major block (the data of ranks [index * W/k, (index + 1) * W/k)); the k
    members then hold the whole unit. A copied group's block is rebuilt from the gathered
    parameters (its staging is gone), one pack."""
    per = world // k
    chunks = []
    for g in bucket.layout.groups:
        n = per * g.shard_numel
        if not g.copied:
            chunks.append(full.narrow(0, g.full_offset + index * n, n).clone())
            continue
        srcs, offsets = [], []
        for slot_index, rank, offset, count, start in bucket.layout.rank_major_pieces(g):
            if index * per <= rank < (index + 1) * per:
                srcs.append(full.narrow(0, bucket.layout.slots[slot_index].full_offset + start,
                                        count))
                offsets.append(offset - index * n)
        chunk = torch.empty(n, dtype=full.dtype, device=full.device)
        ops.pack(srcs, offsets, chunk, 0)
        chunks.append(chunk)
    return chunks
