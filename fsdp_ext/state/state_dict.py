"""What `model.state_dict()` returns for a sharded model, with exactly the unwrapped model's keys.

Two kinds, picked per unit (see `state_dict_type`):
  * sharded (the default, as FSDP2 returns DTensors): each sharded parameter is a `ShardedTensor`
    over the parameter flattened to 1-D, whose local shard is this rank's shard view (no copy, no
    collective); `torch.distributed.checkpoint` saves it and reshards it to any world size;
  * full: each parameter gathered to its own shape, bucket by bucket (every rank must call),
    optionally only on rank 0 and/or moved to the CPU.

A post-hook on every unit's module rewrites the entries of that unit's parameters after nn.Module
built the dict (where they are the 1-D local views). nn.Module runs a module's hook after those of
its whole subtree, in the same order on every rank, so the gathers of the full kind line up.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.placement import dtensor_params
from ..runtime.core.registry import unit_of, units_of
from .names import unwrapped_name
from .sharded_tensor import flat_sharded_tensor

SETTINGS_ATTR = "_fsdp_ext_state_dict_settings"
OPTIM_SETTINGS_ATTR = "_fsdp_ext_optim_state_dict_settings"


@dataclass(frozen=True)
class StateDictSettings:
    full: bool = False          # False: sharded (ShardedTensor) entries
    rank0_only: bool = False    # full only: other ranks return no entries
    cpu_offload: bool = False   # move every entry (sharded: every local shard) to the CPU


def settings_of(unit) -> StateDictSettings:
    return getattr(unit, SETTINGS_ATTR, None) or StateDictSettings()


def optim_settings_of(unit) -> StateDictSettings:
    """What FullyShardedDataParallel.optim_state_dict returns (set by state_dict_type)."""
    return getattr(unit, OPTIM_SETTINGS_ATTR, None) or StateDictSettings()


def set_state_dict_settings(model: nn.Module, settings: StateDictSettings,
                            optim: StateDictSettings | None = None) -> None:
    for unit in units_of(model):
        setattr(unit, SETTINGS_ATTR, settings)
        if optim is not None:
            setattr(unit, OPTIM_SETTINGS_ATTR, optim)


@contextlib.contextmanager
def state_dict_settings(model: nn.Module, settings: StateDictSettings,
                        optim: StateDictSettings | None = None):
    """Use `settings` for every unit under `model` inside the block, then restore the old ones."""
    units = units_of(model)
    old = [(settings_of(u), optim_settings_of(u)) for u in units]
    set_state_dict_settings(model, settings, optim)
    try:
        yield
    finally:
        for unit, (previous, previous_optim) in zip(units, old):
            setattr(unit, SETTINGS_ATTR, previous)
            setattr(unit, OPTIM_SETTINGS_ATTR, previous_optim)


# ---- keys -------------------------------------------------------------------------------------------
def slot_keys(unit, module: nn.Module) -> dict[int, list[str]]:
    """id(slot) -> every state-dict key (relative to `module`, one of the unit's modules) that
    names its parameter; none for a parameter of another module of a list unit.

    Tied weights have one key per (module, attribute) that holds them, as nn.Module gives; computed
    at call time because wrappers applied after sharding may change the module tree.
    """
    names: dict[int, list[str]] = {}
    for name, module in module.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(unwrapped_name(name))
    keys: dict[int, list[str]] = {}
    for bucket in unit.buckets:
        for slot in bucket.slots:
            keys[id(slot)] = [f"{n}.{attr}" if n else attr
                              for module, attr in slot.locations for n in names.get(id(module), [])]
    return keys


# ---- the post-hook ----------------------------------------------------------------------------------
def post_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    unit = unit_of(module)
    settings = settings_of(unit)
    if settings.full:
        _fill_full(unit, module, state_dict, prefix, settings)
    else:
        _fill_sharded(unit, module, state_dict, prefix, settings.cpu_offload)


def _fill_sharded(unit, module: nn.Module, state_dict: dict, prefix: str,
                  cpu_offload: bool) -> None:
    keys = slot_keys(unit, module)
    distributed = dist.is_available() and dist.is_initialized()
    for bucket in unit.buckets:
        if bucket.layout.kind == "rows":
            # The parameters are DTensors (or, without a process group, full tensors): nn.Module's
            # `param.detach()` would give the wrapper the view's offset into the shard, which
            # checkpoint stagers take for a storage of its own (dtensor_params.detached).
            if bucket.distributed:
                for slot in bucket.slots:
                    for key in keys[id(slot)]:
                        if prefix + key in state_dict:
                            state_dict[prefix + key] = dtensor_params.detached(slot.param)
            continue
        for index, slot in enumerate(bucket.slots):
            local = slot.param.detach()
            local = local.cpu() if cpu_offload else local
            # Without a process group there is nothing to shard over: hand out the plain tensor.
            value = (flat_sharded_tensor(bucket, index, local, unit.groups.shard) if distributed
                     else local.view(slot.shape))
            for key in keys[id(slot)]:
                if prefix + key in state_dict:
                    state_dict[prefix + key] = value


def _fill_full(unit, module: nn.Module, state_dict: dict, prefix: str,
               settings: StateDictSettings) -> None:
    keys = slot_keys(unit, module)
    keep = not settings.rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    with torch.no_grad():
        for bucket in unit.buckets:
            if not any(keys[id(slot)] for slot in bucket.slots):
                continue  # another module's of a list unit: gathered at that module's hook
            tensors = gather_bucket(unit, bucket, bucket.shard)  # every rank takes part
            for slot, tensor in zip(bucket.slots, tensors):
                tensor = slot.placement.full_tensor(tensor)  # (TP's local part: the whole)
                tensor = tensor.cpu() if settings.cpu_offload and keep else tensor
                for key in keys[id(slot)]:
                    if prefix + key in state_dict:
                        state_dict[prefix + key] = tensor
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if not keep:  # rank0_only: the others return nothing of this unit's subtree
            del state_dict[key]
        elif settings.cpu_offload and isinstance(state_dict[key], torch.Tensor):
            state_dict[key] = state_dict[key].cpu()


def gather_bucket(unit, bucket, shard: torch.Tensor) -> list[torch.Tensor]:
    """All-gather one bucket's `shard` (its parameters' shard, or its gradients') in its own
    dtype; the full-shape tensors (views of one buffer). Tensor-subclass parameters: each
    DTensor's `full_tensor()`, the subclass's own gather (as torch's state-dict helpers do)."""
    parameters = shard is bucket.shard
    local = shard.to(bucket.groups.device) if shard is not None else None  # (maybe offloaded)
    return bucket.wire.gather_full(bucket, bucket.groups, local, parameters)


# ---- public functions -------------------------------------------------------------------------------
def full_state_dict(model: nn.Module, *, rank0_only: bool = False,
                    cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """The unwrapped model's `state_dict()`, parameters gathered one bucket at a time.

    Every rank must call it (it all-gathers). With `rank0_only`, other ranks get an empty dict;
    with `cpu_offload`, tensors are moved to the CPU as soon as they are gathered.
    """
    settings = StateDictSettings(full=True, rank0_only=rank0_only, cpu_offload=cpu_offload)
    with state_dict_settings(model, settings):
        result = model.state_dict()
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return result


def sharded_state_dict(model: nn.Module) -> dict:
    """`model.state_dict()` in the sharded form (ShardedTensor entries), whatever the setting."""
    with state_dict_settings(model, StateDictSettings()):
        return model.state_dict()
