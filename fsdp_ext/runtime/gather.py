"""The all-gather of one bucket, group by group (layout.py, [Note: gather groups]).

    targets:   per group, the W * Q buffer its collective fills: a slice of the gathered buffer
               (direct group), or a staging buffer (copied group)
    copy-in:   this rank's region of the source (its shard, or a post-forward chunk) cast into its
               slot of each target
    collective per group (an in-place all-gather)
    copy-out:  copied groups' staging unpacked into each parameter's place, one launch; staging freed

The unit's unshard runs these steps on a side stream, on the CPU issue thread, or on the compute
thread; the state code uses them to gather full parameters in their original dtype.
"""
from __future__ import annotations

import torch

from .. import ops
from . import comm, storage_cache
from .bucket import Bucket


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
        if target.dtype in ops.checks.FLOAT_DTYPES:
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
