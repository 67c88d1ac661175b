"""`summon_full_params`: full-shape, full-precision parameters in place, for inspection or editing.

Inside the block every sharded `nn.Parameter` (the same objects the optimizer holds) has its full
shape and value; with `writeback=True` edits are copied back into this rank's shard on exit. Every
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
                tensors = gather_bucket_params(unit, bucket)
                for slot, tensor in zip(bucket.slots, tensors):
                    slot.param.data = tensor
                gathered.append((bucket, tensors))
    try:
        yield
    finally:
        with torch.no_grad():
            for bucket, tensors in gathered:
                if writeback:
                    for slot, tensor, view in zip(bucket.slots, tensors, bucket.shard_views):
                        start, end = bucket.local_range(slot)
                        offset = bucket.shard_start + start - slot.offset
                        view.copy_(tensor.reshape(-1)[offset:offset + (end - start)])
                bucket.point_params_at_shard()
