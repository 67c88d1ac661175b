"""Optimizer state dicts keyed by parameter names, full or sharded.

A `torch.optim` optimizer over a sharded model steps on the parameters' shards (fully_shard's
DTensor parameters, or FullyShardedDataParallel's 1-D views), so its state tensors shaped like a
parameter (exp_avg, momentum_buffer, ...) are sharded exactly like it; anything else (the scalar
`step`, python numbers) is the same on every rank.

    {"state": {name: {key: value}}, "param_groups": [{..hyperparameters.., "params": [names]}]}

  * full: sharded state tensors gathered to the parameter's shape (bucket by bucket, one all-gather
    per state key), equal to what the unwrapped model's optimizer holds, re-keyed by name;
  * sharded: each sharded state tensor as the optimizer holds it for DTensor parameters, or, for
    FSDP1's flat views, as a ShardedTensor over the flattened parameter laid out like the model's
    sharded state dict; torch.distributed.checkpoint reshards either.

Names are those of `model.named_parameters()` (a tied weight is named once, by its first name).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.placement import dtensor_params
from ..runtime.core.registry import units_of
from .names import unwrapped_name
from .sharded_tensor import flat_sharded_tensor


@dataclass
class ParamInfo:
    name: str
    unit: object
    bucket: object
    index: int       # the parameter's place in its bucket

    @property
    def slot(self):
        return self.bucket.slots[self.index]


def param_infos(model: nn.Module) -> dict[int, ParamInfo]:
    """id(parameter) -> its name and where it lives in the bucket layout."""
    where = {}
    for unit in units_of(model):
        for bucket in unit.buckets:
            for index, slot in enumerate(bucket.slots):
                where[id(slot.param)] = (unit, bucket, index)
    infos = {}
    for name, param in model.named_parameters():
        if id(param) not in where:
            raise ValueError(f"parameter '{name}' is not sharded by fsdp_ext (call fully_shard "
                             "on the root module)")
        infos[id(param)] = ParamInfo(unwrapped_name(name), *where[id(param)])
    return infos


def _is_sharded(value, param: torch.Tensor) -> bool:
    """Local rule: a state tensor shaped like the parameter is sharded like it (a DTensor of the
    DTensor parameter's shape; a 1-D tensor of an FSDP1 flat view's)."""
    if dtensor_params.is_dtensor(param):
        return dtensor_params.is_dtensor(value) and value.shape == param.shape
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == param.shape


def _agreed_sharded_keys(optimizer, infos) -> dict[str, set[str]]:
    """name -> state keys that every rank considers sharded (one small all_gather_object).

    A rank whose part of a parameter has one element cannot tell a [1]-shaped non-sharded state
    from a sharded one on its own; the others can. Also checks that every rank has the same keys,
    so the gathers below line up.
    """
    local = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            local[infos[id(p)].name] = {k: _is_sharded(v, p) for k, v in state.items()}
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {n: {k for k, s in keys.items() if s} for n, keys in local.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    agreed = {}
    for name, keys in local.items():
        for rank, other in enumerate(everyone):
            if set(other.get(name, {})) != set(keys):
                raise RuntimeError(f"optimizer state of '{name}' has keys {sorted(keys)} on rank "
                                   f"{dist.get_rank()} but {sorted(other.get(name, {}))} on rank "
                                   f"{rank}; step the optimizer on every rank")
        agreed[name] = {k for k in keys if all(other[name][k] for other in everyone)}
    return agreed


def _param_groups_by_name(optimizer, infos) -> list[dict]:
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [infos[id(p)].name for p in g["params"]]} for g in optimizer.param_groups]


def optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, full: bool = False, *,
                     rank0_only: bool = False, cpu_offload: bool = False) -> dict:
    """The optimizer's state keyed by parameter names (see the module docstring).

    Every rank must call it. `rank0_only` applies to the full form (other ranks get an empty
    dict); `cpu_offload` moves gathered tensors, or FSDP1's local shards, to the CPU.
    """
    infos = param_infos(model)
    sharded_keys = _agreed_sharded_keys(optimizer, infos)
    state: dict[str, dict] = {}
    if full:
        _gather_full_states(optimizer, infos, sharded_keys, state, cpu_offload)
        if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
            return {}
    else:
        distributed = dist.is_available() and dist.is_initialized()
        for group in optimizer.param_groups:
            for p in group["params"]:
                info = infos[id(p)]
                entry = {}
                for key, value in optimizer.state.get(p, {}).items():
                    if key in sharded_keys[info.name] and not dtensor_params.is_dtensor(value):
                        value = value.cpu() if cpu_offload else value
                        value = (flat_sharded_tensor(info.bucket, info.index, value.contiguous(),
                                                     info.unit.groups.shard) if distributed
                                 else value.view(info.slot.shape))
                    entry[key] = value
                if entry:
                    state[info.name] = entry
    return {"state": state, "param_groups": _param_groups_by_name(optimizer, infos)}


def _gather_full_states(optimizer, infos, sharded_keys, state, cpu_offload) -> None:
    """Fill `state` with every parameter's state, sharded tensors gathered to full shape."""
    params = [(p, infos[id(p)]) for g in optimizer.param_groups for p in g["params"]]
    gathered: dict[tuple[str, str], torch.Tensor] = {}
    units = []
    for _, info in params:
        if info.unit not in units:
            units.append(info.unit)
    # One all-gather per (unit, bucket, state key), in the same order on every rank.
    for unit in units:
        for bucket in unit.buckets:
            members = [(p, info) for p, info in params if info.bucket is bucket]
            for key in sorted({k for _, info in members for k in sharded_keys[info.name]}):
                having = [(p, info) for p, info in members if key in sharded_keys[info.name]]
                fulls = _gather_state(unit, bucket, [info.index for _, info in having],
                                      [optimizer.state[p][key] for p, _ in having])
                for (_, info), tensor in zip(having, fulls):
                    gathered[info.name, key] = tensor
    for p, info in params:
        if not optimizer.state.get(p):
            continue
        entry = {}
        for key, value in optimizer.state[p].items():  # the optimizer's own key order
            value = gathered.get((info.name, key), value)
            entry[key] = value.cpu() if cpu_offload and isinstance(value, torch.Tensor) else value
        state[info.name] = entry


def _gather_state(unit, bucket, indices, tensors) -> list[torch.Tensor]:
    """All-gather state tensors laid out like parameters `indices` of `bucket` (their local
    tensors: DTensors' local parts, or FSDP1's flat views); return them in full shape."""
    device, dtype = unit.groups.device, dtensor_params.local_of(tensors[0]).dtype
    local = torch.zeros(bucket.shard_numel, dtype=dtype, device=device)
    for index, tensor in zip(indices, tensors):
        lo, hi = bucket.layout.local_range(index)
        local[lo:hi].copy_(dtensor_params.local_of(tensor).reshape(-1))
    views = bucket.wire.gather_full(bucket, bucket.groups, local)
    return [views[index] for index in indices]
