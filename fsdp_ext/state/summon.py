"""`summon_full_params`: full-shape, full-precision parameters in place, for inspection or editing.

Inside the block every sharded parameter has its full shape and value (FullyShardedDataParallel's
are the same objects the optimizer holds; fully_shard's DTensor parameters are replaced by full
ones for the block); with `writeback=True` edits are copied back into this rank's shard on exit. Every
rank must enter it (it all-gathers). It holds every unit unsharded at once, so use it on models that
fit, as with FSDP1's `summon_full_params`.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..runtime.registry import units_of
from .state_dict import gather_bucket_params


@contextlib.contextmanager
def summon_full_params(model: nn.Module, writeback: bool = True):
    gathered = []
    with torch.no_grad():
        for unit in units_of(model):
            unit.wait_unshard()
            for bucket in unit.buckets:
                if any(slot.tp_spec is not None for slot in bucket.slots):
                    raise NotImplementedError(
                        f"summon_full_params: unit '{unit.name or '<root>'}' holds tensor-parallel "
                        "parameters; use DTensor.full_tensor() on them instead")
                tensors = gather_bucket_params(unit, bucket)
                for slot, tensor in zip(bucket.slots, tensors):
                    if bucket.distributed:  # a DTensor parameter cannot take a full tensor's data
                        for module, attr in slot.locations:
                            module._parameters[attr] = nn.Parameter(
                                tensor, requires_grad=slot.param.requires_grad)
                    else:
                        slot.param.data = tensor
                gathered.append((unit, bucket, tensors))
    try:
        yield
    finally:
        with torch.no_grad():
            for unit, bucket, tensors in gathered:
                if writeback:
                    for index, (slot, view) in enumerate(zip(bucket.slots, bucket.shard_views)):
                        start, end = bucket.layout.param_range(index)
                        module, attr = slot.locations[0]
                        full = module._parameters[attr] if bucket.distributed else tensors[index]
                        view.view(-1).copy_(full.reshape(-1)[start:end])
                bucket.point_params_at_shard()
                unit.use_sharded_params()
