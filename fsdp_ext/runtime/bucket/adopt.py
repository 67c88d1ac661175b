"""Adopting parameters that nn.Module._apply (`to_empty`, `to`) or `load_state_dict(assign=True)`
gave a unit's modules: their values go into the shard (allocated now, padding zeroed, if it was
on the meta device: Bucket.new_shard) and they view it again."""
from __future__ import annotations

import torch

from ..placement import dtensor_params
from .bucket import OWNER_ATTR, mark_owner


def adopt_params(unit) -> None:
    device = unit.groups.device
    for bucket in unit.buckets:
        current = _current(bucket)
        locals_ = [dtensor_params.local_of(p) for p in current]
        if any(t.is_meta for t in locals_):
            continue  # still (or again) on meta: nothing to adopt
        for slot, param, local in zip(bucket.slots, current, locals_):
            mark_owner(param, getattr(slot.param, OWNER_ATTR, None))
            if local.dtype != bucket.dtype:  # (refuse_cast's probe did not foresee it)
                raise NotImplementedError(
                    f"parameter '{slot.fqn}' changed dtype ({bucket.dtype} -> {local.dtype}) "
                    "after fully_shard: cast the model before sharding it")
        if bucket.on_meta():
            bucket.give_shard_storage(bucket.new_shard(device, unit.offload))
        bucket.adopt(current, locals_)
    unit.params.params_replaced()


def _current(bucket) -> list:
    return [slot.locations[0][0]._parameters[slot.locations[0][1]] for slot in bucket.slots]


def refuse_cast(units, fn) -> None:
    """Before nn.Module._apply runs `fn` (it swaps new contents into the parameter objects, so a
    refusal afterwards could not leave the model as it was): a bucket's shard, gathered buffers
    and wire are built for one dtype, so a cast after sharding (`model.to(torch.bfloat16)`,
    `.half()`, `.double()`) is refused, `fn` tried on an empty tensor of each bucket's dtype."""
    for unit in units:
        for bucket in unit.buckets:
            slot = bucket.slots[0]
            local = dtensor_params.local_of(slot.param)
            probe = fn(torch.empty(0, dtype=bucket.dtype, device=local.device))
            if probe.dtype == bucket.dtype:
                continue
            raise NotImplementedError(
                f"fsdp_ext: parameter '{unit.param_name(slot)}' of unit '{unit.name or '<root>'}' "
                f"({unit.type_name}) would change dtype ({bucket.dtype} -> {probe.dtype}) after "
                "sharding, which fsdp_ext does not support (torch's FSDP2 casts the shards); the "
                "model is unchanged. To compute in another dtype use MixedPrecisionPolicy("
                "param_dtype=...); to store another dtype cast the model before fully_shard; to "
                "export one, cast the full state dict (get_model_state_dict with "
                "StateDictOptions(full_state_dict=True))")
