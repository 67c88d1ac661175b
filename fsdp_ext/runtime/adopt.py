"""Adopting parameters that nn.Module._apply (`to_empty`, `to`) or `load_state_dict(assign=True)`
gave a unit's modules: their values go into the shard (allocated now, padding zeroed, if it was
on the meta device: param_buckets.new_shard) and they view it again."""
from __future__ import annotations

import torch

from . import dtensor_params
from .param_buckets import OWNER_ATTR, new_shard


def adopt_params(unit) -> None:
    device = unit.groups.device
    for bucket in unit.buckets:
        current = [slot.locations[0][0]._parameters[slot.locations[0][1]] for slot in bucket.slots]
        locals_ = [dtensor_params.local_of(p) for p in current]
        if any(t.is_meta for t in locals_):
            continue  # still (or again) on meta: nothing to adopt
        for slot, param, local in zip(bucket.slots, current, locals_):
            setattr(param, OWNER_ATTR, getattr(slot.param, OWNER_ATTR, None))
            if local.dtype != bucket.dtype:
                raise NotImplementedError(
                    f"parameter '{slot.fqn}' changed dtype ({bucket.dtype} -> {local.dtype}) "
                    "after fully_shard: cast the model before sharding it")
            slot.param = param
        if bucket.extension:  # tensor subclasses: the new chunks are the shard (extension.py)
            bucket.shard_views = locals_
            continue
        if bucket.shard.is_meta:
            bucket.shard = new_shard(bucket, device, unit.offload)
            bucket.shard_views = bucket.local_views(bucket.shard)
        with torch.no_grad():
            for view, local in zip(bucket.shard_views, locals_):
                if view.numel() and local.data_ptr() != view.data_ptr():
                    view.copy_(local.reshape(view.shape))
        bucket.point_params_at_shard()
    unit.params.params_replaced()
