"""The all-gather of one bucket, group by group (layout.py, [Note: gather groups]).

    targets:   per group, the W * Q buffer its collective fills: a slice of the gathered buffer
               (direct group), or a staging buffer (copied group)
    copy-in:   this rank's region of the source (its shard, or a post-forward chunk) cast into its
               slot of each target
    collective per group (an in-place all-gather)
    copy-out:  copied groups' staging unpacked into each parameter's place, one launch; staging freed

`start` is the unit's one all-gather path, behind the streams seam: on CPU the copy-in and the
collectives run on the issue thread (comm.issue_all_gather), with side streams on the all-gather
stream (comm.Streams.launch), else on the calling thread; `InFlightGather.finish` waits and copies
out. The state code uses the steps alone to gather full parameters in their original dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import ops
from . import comm, process_groups, quantized_comm, storage_cache
from .bucket import Bucket
from .offload import to_compute_device
from .trace import profiler_range


@dataclass(eq=False)
class InFlightGather:
    """One unshard from its launch to `finish()`: the collectives, and the staging buffers whose
    copy-out waits for them (None once copied out, or when stream order copies out)."""

    pending: comm.Pending
    kind: str                                   # "all_gather", or "unshard_copy" (no group)
    copy_out: list | None = None                # per bucket, its targets (copied out at finish)
    buckets: list = field(default_factory=list)
    fulls: list = field(default_factory=list)   # per bucket, the gathered buffer (.data alias)
    name: str = ""                              # the unit's, for the profiler

    def finish(self) -> None:
        self.pending.wait()
        targets, self.copy_out = self.copy_out, None
        if targets is not None:
            _copy_out_all(self.buckets, self.fulls, targets, self.name)


def start(buckets: list[Bucket], fulls: list[torch.Tensor], chunks, group, slot: int, world: int,
          streams_: comm.Streams, *, offload: bool, label: str, name: str, tags,
          after_event=None) -> InFlightGather:
    """Gather every bucket into its buffer in `fulls` (filled here): this rank's shard, or its
    post-forward `chunks`, goes into `slot`; `group` None is a local copy. `tags()` makes the
    collectives' tags (fingerprints.py), exchanged on the collectives' own order."""
    kind = "all_gather" if group is not None else "unshard_copy"
    record = InFlightGather(None, kind, buckets=buckets, fulls=fulls, name=name)
    if streams_.issue_thread:  # CPU: copy-in and broadcasts off this thread
        targets_, sources_, issued_targets, here = [], [], [], []
        for i, (bucket, full) in enumerate(zip(buckets, fulls)):  # (host shards read in place)
            bucket_targets, bucket_sources, entry = _fill(bucket, full, chunks, i, world, slot,
                                                          group, offload=False)
            targets_.append(entry)
            # Byte buffers (subclass or quantized buckets): not for the issue thread's cast kernel.
            if bucket_targets and bucket_targets[0].dtype == torch.uint8:
                here.append((bucket_targets, bucket_sources))
                continue
            issued_targets += bucket_targets
            sources_ += bucket_sources
        record.copy_out = targets_
        # The tag goes on `group`, issued by this thread; the data on the issue thread's own
        # group: each group's collectives keep one order on every rank. Byte buffers go on
        # `group` too, from this thread, right after the tag.
        issued = [t.exchange() for t in tags() if t is not None]
        record.pending = comm.issue_all_gather(
            issued_targets, sources_, slot, process_groups.issue_thread_group(group),
            label, streams_.timeout)
        for bucket_targets, bucket_sources in here:
            record.pending.works += copy_in_and_gather(bucket_targets, bucket_sources, slot,
                                                       group, async_op=True)
        record.pending.tags = issued
        return record

    def fill_and_gather(async_op: bool) -> list:
        """(Side streams: on the all-gather stream, allocations included.) Copy out at once when
        the collectives are synchronous; else at `finish()`."""
        works, targets_ = [], []
        for i, (bucket, full) in enumerate(zip(buckets, fulls)):
            bucket_targets, sources_, entry = _fill(bucket, full, chunks, i, world, slot, group,
                                                    offload)
            targets_.append(entry)
            with profiler_range("copy_in", name):
                works += copy_in_and_gather(bucket_targets, sources_, slot, group, async_op)
        if async_op:
            record.copy_out = targets_
        else:
            _copy_out_all(buckets, fulls, targets_, name)
        return works

    # With side streams the copy-in reads the post-forward chunks (allocated by the compute
    # stream) on the all-gather stream: they are held until it is waited for.
    record.pending = streams_.launch(
        "all_gather", fill_and_gather, keep_alive=[c for cs in chunks or () for c in cs],
        label=label, after_event=after_event, tags=tags)
    return record


def _fill(bucket: Bucket, full: torch.Tensor, chunks, index: int, world: int, slot: int, group,
          offload: bool):
    """Give `full` its storage; (per group, the buffer its collective fills; per group, what this
    rank contributes: its post-forward chunk, or its shard, copied to the device if offloaded;
    what the copy-out takes: those buffers, or the quantized gathers that fill them).
    A subclass bucket: one byte buffer, this rank's slot already filled by its pre-hooks. A
    CommPolicy's param_gather: per group a byte buffer, this rank's slot already quantized (not
    for a local copy, nor a regather from post-forward chunks, which hold gathered values)."""
    storage_cache.fill(full)
    if bucket.extension:
        staging = bucket.fill_staging(slot, world, full.device)
        return [staging], [_slot_of(staging, slot, world)], [staging]
    if chunks is not None:
        out = targets(bucket, full, world)
        return out, chunks[index], out
    shard = to_compute_device(bucket.shard, full.device) if offload else bucket.shard
    policy = bucket.comm_policy
    if policy is not None and policy.param_gather is not None and group is not None:
        gathers = quantized_comm.quantize_for_gather(
            bucket, targets(bucket, full, world), sources(bucket, shard), slot, world, policy)
        wires = [g.wire for g in gathers]
        return wires, [_slot_of(w, slot, world) for w in wires], gathers
    out = targets(bucket, full, world)
    return out, sources(bucket, shard), out


def _slot_of(buffer: torch.Tensor, slot: int, world: int) -> torch.Tensor:
    """Slot `slot` of a buffer of `world` equal slots (already filled: the byte buffers)."""
    size = buffer.numel() // world
    return buffer.narrow(0, slot * size, size)


def _copy_out_all(buckets, fulls, targets_, name: str) -> None:
    with profiler_range("copy_out", name):
        for bucket, full, bucket_targets in zip(buckets, fulls, targets_):
            if bucket.extension:  # its bytes go to its post-hooks (extension.py)
                bucket.unpack(bucket_targets[0])
                continue
            if bucket_targets and isinstance(bucket_targets[0], quantized_comm.QuantizedGather):
                bucket_targets = [g.finish() for g in bucket_targets]  # dequantized into place
            copy_out(bucket, full, bucket_targets)


def targets(bucket: Bucket, full: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Per group, the buffer its collective fills (staging allocated here for copied groups)."""
    out = []
    for g in bucket.layout.groups:
        if g.copied:
            out.append(storage_cache.empty(world * g.shard_numel, full.dtype, full.device))
        else:
            out.append(full.narrow(0, g.full_offset, world * g.shard_numel))
    return out


def sources(bucket: Bucket, shard: torch.Tensor) -> list[torch.Tensor]:
    """Per group, its region of a shard-shaped tensor (what this rank contributes)."""
    return [shard.narrow(0, g.shard_offset, g.shard_numel) for g in bucket.layout.groups]


def copy_in_and_gather(targets_: list[torch.Tensor], sources_: list[torch.Tensor], slot: int,
                       group, async_op: bool) -> list:
    """Cast each source into its slot of its target, then gather the other slots over `group`."""
    works = []
    for target, source in zip(targets_, sources_):
        if not target.numel():
            continue
        if source.data_ptr() == target.narrow(0, slot * source.numel(), 1).data_ptr():
            pass  # already in its slot (a subclass bucket's bytes)
        elif target.dtype in ops.checks.FLOAT_DTYPES:
            ops.cast_into_slot(source, target, slot)
        else:  # (optimizer state of another dtype, gathered for a full state dict)
            target.narrow(0, slot * source.numel(), source.numel()).copy_(source)
        if group is not None:
            slot_view = target.narrow(0, slot * source.numel(), source.numel())
            works.append(comm.all_gather_into(target, slot_view, group, async_op))
    return works


def copy_out(bucket: Bucket, full: torch.Tensor, targets_: list[torch.Tensor]) -> None:
    """Unpack the copied group's staging (a bucket has at most one copied group) into its
    parameters' places in `full`, one launch, then give the staging back."""
    for g, staging in zip(bucket.layout.groups, targets_):
        if not g.copied:
            continue
        offsets, outs = [], []
        for index, rank, offset, count in bucket.layout.rank_major_pieces(g):
            start = bucket.layout.param_range(index, rank)[0]
            outs.append(full.narrow(0, bucket.layout.slots[index].full_offset + start, count))
            offsets.append(offset)
        if outs and staging.dtype in ops.checks.FLOAT_DTYPES:
            ops.unpack(staging, 0, offsets, outs)
        else:
            for out, offset in zip(outs, offsets):
                out.copy_(staging.narrow(0, offset, out.numel()))
        storage_cache.recycle(staging)


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
        for slot_index, rank, offset, count in bucket.layout.rank_major_pieces(g):
            if index * per <= rank < (index + 1) * per:
                start = bucket.layout.param_range(slot_index, rank)[0]
                srcs.append(full.narrow(0, bucket.layout.slots[slot_index].full_offset + start,
                                        count))
                offsets.append(offset - index * n)
        chunk = torch.empty(n, dtype=full.dtype, device=full.device)
        ops.pack(srcs, offsets, chunk, 0)
        chunks.append(chunk)
    return chunks
