"""State dicts with exactly the unwrapped model's keys and shapes, gathered from the shards."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import comm, ops
from .schedule import units_of


def gather_bucket_params(unit, bucket) -> list[torch.Tensor]:
    """All-gather one bucket (original dtype) and unpack it into full-shape parameter tensors."""
    full = torch.empty(bucket.numel_padded, dtype=bucket.dtype, device=bucket.shard.device)
    if unit.groups.shard is None:
        full.copy_(bucket.shard)
    else:
        comm.all_gather_into(full, bucket.shard, unit.groups.shard, async_op=False)
    outs = [torch.empty(slot.shape, dtype=bucket.dtype, device=full.device) for slot in bucket.slots]
    ops.unpack(full, 0, [slot.offset for slot in bucket.slots], outs)
    return outs


@torch.no_grad()
def full_state_dict(model: nn.Module, *, rank0_only: bool = False,
                    cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """The unwrapped model's `state_dict()`, parameters gathered one bucket at a time.

    Every rank must call it (it all-gathers). With `rank0_only`, other ranks get an empty dict;
    with `cpu_offload`, tensors are moved to the CPU as soon as they are gathered.
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    full_by_param: dict[int, torch.Tensor] = {}
    for unit in units_of(model):
        for bucket in unit.buckets:
            for slot, tensor in zip(bucket.slots, gather_bucket_params(unit, bucket)):
                if keep:
                    full_by_param[id(slot.param)] = tensor.cpu() if cpu_offload else tensor
    if not keep:
        return {}
    result = {}
    for key, value in model.state_dict(keep_vars=True).items():
        value = full_by_param.get(id(value), value)
        result[key] = (value.cpu() if cpu_offload else value).detach()
    return result
