"""`model.load_state_dict(sd)` for a sharded model: full tensors or the sharded (ShardedTensor) form.

A pre-hook on every unit's module runs before nn.Module loads that module and its subtree. For each
parameter of the unit whose key is present it takes only this rank's part (a slice of the full
tensor, or of the ShardedTensor's local shard) and writes every such part of a bucket into the local
shard with one `ops.pack` over the shard's window, casting to the bucket's dtype: no full-bucket
temporary, no collective. It then hands nn.Module the parameter's own shard view for each key, so
the default loader's shape check passes and its copy is a no-op, while strict key checking
(missing / unexpected keys) stays nn.Module's own.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from .. import ops
from ..runtime.placement import dtensor_params
from ..runtime.core.registry import unit_of
from .sharded_tensor import local_param_range, local_part_of
from .state_dict import StateDictSettings, slot_keys, state_dict_settings


def load_pre_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict,
                  missing_keys, unexpected_keys, error_msgs: list) -> None:
    unit = unit_of(module)
    if unit.schedule is not None:  # (CPU offload) a copy of the shards may still be reading them
        unit.schedule.host_reads.sync()
    if local_metadata.get("assign_to_params_buffers"):
        raise NotImplementedError("load_state_dict(assign=True) would replace the sharded "
                                  "parameters; load without assign")
    keys = slot_keys(unit, module)
    with torch.no_grad():
        for bucket in unit.buckets:
            parts = []  # (index, this rank's part as a 1-D tensor)
            for index, slot in enumerate(bucket.slots):
                present = [prefix + k for k in keys[id(slot)] if prefix + k in state_dict]
                if not present:
                    continue  # nn.Module reports it as missing (strict) or leaves it
                value = state_dict[present[0]]
                if dtensor_params.is_dtensor(value):
                    continue  # DTensor to DTensor parameter: nn.Module's copy_ (resharding if needed)
                try:
                    # (None: the wire format wrote it itself, e.g. a subclass's own copy_)
                    part = bucket.wire.load_value(bucket, index, value, present[0], _local_part)
                    if part is not None and not _is_shard_view(part, bucket.shard_views[index]):
                        parts.append((index, part))
                except ValueError as exc:
                    error_msgs.append(str(exc))
                for key in present:
                    state_dict[key] = slot.param.detach()
            _write_parts(bucket, parts)


def _is_shard_view(part: torch.Tensor, view: torch.Tensor) -> bool:
    return (part.dtype == view.dtype and part.device == view.device and part.numel() == view.numel()
            and part.numel() > 0 and part.data_ptr() == view.data_ptr())


def _local_part(bucket, index: int, value, key: str) -> torch.Tensor:
    """This rank's elements of `value` (full tensor, or flattened ShardedTensor of the flat
    layout) for parameter `index`, flattened."""
    slot = bucket.slots[index]
    slot.placement.require_whole(lambda: ValueError(
        f"{key}: a tensor-parallel parameter loads from a DTensor state dict (model.state_dict(), "
        f"DCP) or torch's set_model_state_dict, not from a {type(value).__name__}"))
    if isinstance(value, ShardedTensor):
        size = list(value.metadata().size)  # (not .size(): ShardedTensor's tensor ops warn)
        if bucket.layout.kind != "flat" or size != [slot.numel]:
            raise ValueError(f"size mismatch for {key}: the sharded entry has global size "
                             f"{size}, the parameter has shape {list(slot.shape)} "
                             f"(flattened [{slot.numel}])")
        return local_part_of(value, *local_param_range(bucket, index), key)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{key}: expected a tensor or ShardedTensor, got {type(value).__name__}")
    if value.shape != slot.shape:
        raise ValueError(f"size mismatch for {key}: copying a param with shape "
                         f"{list(value.shape)} from checkpoint, the shape in current model is "
                         f"{list(slot.shape)}")
    return bucket.layout.local_part(index, value).reshape(-1)


def _write_parts(bucket, parts: list) -> None:
    """Write each (index, part) into the local shard; one pack when the bucket is complete."""
    shard = bucket.shard

    def source(index, part):
        part = part.to(device=shard.device)
        if part.dtype not in ops.checks.FLOAT_DTYPES:
            part = part.to(bucket.dtype)
        # A part that aliases the shard (a state dict of this very model) must not be read while
        # pack zeroes and rewrites the window.
        if part.numel() and part.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr():
            part = part.clone()
        return part.contiguous(), bucket.layout.local_range(index)[0]

    if len(parts) == len(bucket.slots):  # the whole shard is known: one launch, padding zeroed
        srcs, offsets = zip(*(source(i, p) for i, p in parts)) if parts else ((), ())
        ops.pack(list(srcs), list(offsets), shard, 0)
        return
    for index, part in parts:  # some parameters keep their values: write only the others' windows
        lo, hi = bucket.layout.local_range(index)
        if hi > lo:
            src, offset = source(index, part)
            ops.pack([src], [offset], shard[lo:hi], lo)


def load_full_state_dict(model: nn.Module, state_dict: dict, strict: bool = True):
    """Load a full (unsharded) state dict, as `full_state_dict` returns, into a sharded model.

    Every rank passes the full dict (no collective); each copies only its own part of each
    parameter. Returns nn.Module's (missing_keys, unexpected_keys).
    """
    with state_dict_settings(model, StateDictSettings(full=True)):
        return model.load_state_dict(state_dict, strict=strict)
