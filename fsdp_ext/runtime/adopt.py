"""Adopting parameters that nn.Module._apply (`to_empty`, `to`) or `load_state_dict(assign=True)`
gave a unit's modules: their values go into the shard (allocated now, padding zeroed, if it was
on the meta device: Bucket.new_shard) and they view it again."""
from __future__ import annotations

from . import dtensor_params
from .bucket import OWNER_ATTR, mark_owner


def adopt_params(unit) -> None:
    device = unit.groups.device
    for bucket in unit.buckets:
        current = [slot.locations[0][0]._parameters[slot.locations[0][1]] for slot in bucket.slots]
        locals_ = [dtensor_params.local_of(p) for p in current]
        if any(t.is_meta for t in locals_):
            continue  # still (or again) on meta: nothing to adopt
        for slot, param, local in zip(bucket.slots, current, locals_):
            mark_owner(param, getattr(slot.param, OWNER_ATTR, None))
            if local.dtype != bucket.dtype:
                raise NotImplementedError(
                    f"parameter '{slot.fqn}' changed dtype ({bucket.dtype} -> {local.dtype}) "
                    "after fully_shard: cast the model before sharding it")
        if bucket.on_meta():
            bucket.give_shard_storage(bucket.new_shard(device, unit.offload))
        bucket.adopt(current, locals_)
    unit.params.params_replaced()
