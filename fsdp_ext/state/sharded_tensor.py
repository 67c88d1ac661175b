"""A sharded parameter as a `ShardedTensor` over its flattened 1-D view, built without collectives.

Every rank knows the whole bucket layout, so it knows which elements of each parameter every rank of
the shard group owns (layout.py: `param_range`, one contiguous range of the flattened parameter in
the flat layout of FullyShardedDataParallel, whose parameters these describe). Describing the parameter flattened to 1-D (global size
[numel]) makes each rank's part one contiguous chunk, which `torch.distributed.checkpoint` saves
as is and reshards on load by intersecting 1-D ranges: any world size can read what any other wrote.

Replicas (HSDP, NO_SHARD) describe identical chunks; DCP's save planner keeps one copy of each
(it dedupes write items by (key, offset)), and on load every replica reads its own chunk.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                               TensorProperties)

from ..runtime.bucket.bucket import Bucket


def local_param_range(bucket: Bucket, index: int) -> tuple[int, int]:
    """This rank's [start, end) of the flattened parameter `index` (what its shard view holds)."""
    return bucket.layout.param_range(index)


def _global_ranks(shard_group) -> list[int]:
    if shard_group is None:  # not sharded: this rank holds everything
        return [dist.get_rank()]
    return dist.get_process_group_ranks(shard_group)


def flat_sharded_tensor(bucket: Bucket, index: int, local: torch.Tensor,
                        shard_group) -> ShardedTensor:
    """A ShardedTensor of global size [numel] of parameter `index`, whose one local shard is `local`.

    Args:
        bucket, index: the layout that says which rank owns which range, and the parameter.
        local: this rank's part, a contiguous 1-D tensor of local_param_range's length (the
            parameter's shard view, or an optimizer state tensor of the same shape).
        shard_group: the unit's shard group (None when the unit is not sharded).
    """
    ranks = _global_ranks(shard_group)
    device = local.device
    slot = bucket.slots[index]
    shards_md, local_shards = [], []
    for shard_rank, global_rank in enumerate(ranks):
        start, end = bucket.layout.param_range(index, shard_rank)
        if end == start:
            # A rank that owns nothing still gets a local shard: an empty one at the end, where it
            # overlaps nothing. DCP's planners drop a ShardedTensor without local shards from that
            # rank's flattened state dict, and a key missing on some rank sends DCP's loader down
            # its pre-2.4 compatibility path, which breaks lists such as param_groups.
            start = end = slot.numel
        md = ShardMetadata(shard_offsets=[start], shard_sizes=[end - start],
                           placement=f"rank:{global_rank}/{device}")
        shards_md.append(md)
        if shard_rank == bucket.layout.rank:
            if local.numel() != end - start:
                raise AssertionError(f"local part of '{slot.fqn}' has {local.numel()} elements, "
                                     f"layout says {end - start}")
            local_shards.append(Shard(local.detach().reshape(end - start), md))
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=local.is_pinned())
    meta = ShardedTensorMetadata(shards_metadata=shards_md, size=torch.Size([slot.numel]),
                                 tensor_properties=props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, meta, process_group=shard_group)


def local_part_of(value: ShardedTensor, start: int, end: int, name: str) -> torch.Tensor:
    """Elements [start, end) of a flattened ShardedTensor, which must lie in one local shard."""
    if end == start:
        return torch.empty(0, dtype=value.metadata().tensor_properties.dtype)
    for shard in value.local_shards():
        (offset,), (size,) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if offset <= start and end <= offset + size:
            return shard.tensor.reshape(-1)[start - offset:end - offset]
    have = [(s.metadata.shard_offsets, s.metadata.shard_sizes) for s in value.local_shards()]
    raise ValueError(
        f"'{name}': the sharded entry's local shards {have} do not hold this rank's range "
        f"[{start}, {end}); load a sharded state dict of another layout with "
        "torch.distributed.checkpoint into model.state_dict() (or use a full state dict)")
