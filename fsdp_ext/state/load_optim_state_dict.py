"""Loading a name-keyed optimizer state dict (full or sharded form, see optim_state_dict.py).

Each rank keeps only its part of every sharded state tensor (a slice of the full tensor, or of the
ShardedTensor's local shard) and hands torch.optim its own index-keyed format, so any
`torch.optim` optimizer loads it, including one that has not stepped yet (it has no state to match).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from ..runtime.placement import dtensor_params
from .optim_state_dict import ParamInfo, param_infos
from .sharded_tensor import local_param_range, local_part_of


def load_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict) -> None:
    """Load a name-keyed optimizer state dict (full or sharded form, from any world size when full;
    sharded entries must hold this rank's ranges, as after a DCP load into a template).

    Works on an optimizer that has not stepped yet. Hyperparameters (lr, betas, ...) come from the
    saved param_groups, matched to the optimizer's groups by parameter names. Every rank calls it
    with the whole dict (no collective).
    """
    optimizer.load_state_dict(to_local_optim_state_dict(model, optimizer, osd))


def to_local_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                              osd: dict) -> dict:
    """`osd` (name-keyed) as torch.optim's own index-keyed state dict of this rank's shards."""
    infos = param_infos(model)
    by_name = {info.name: (p, info) for p, info in
               ((p, infos[id(p)]) for g in optimizer.param_groups for p in g["params"])}
    unknown = sorted(set(osd.get("state", {})) - set(by_name))
    if unknown:
        raise KeyError(f"optimizer state for parameters this optimizer does not hold: {unknown}")
    index = {name: i for i, name in enumerate(by_name)}
    state = {}
    for name, entry in osd.get("state", {}).items():
        p, info = by_name[name]
        state[index[name]] = {k: _local_value(k, v, info, p) for k, v in entry.items()}
    groups = _match_groups(optimizer, infos, osd["param_groups"], index)
    return {"state": state, "param_groups": groups}


def _local_value(key: str, value, info: ParamInfo, param: torch.Tensor):
    """This rank's part of a saved state value (a private copy: the optimizer owns it), shaped
    like the parameter's local tensor: a DTensor like the parameter when it is one."""
    local = _local_part(key, value, info, param)
    if (dtensor_params.is_dtensor(param) and isinstance(local, torch.Tensor)
            and not dtensor_params.is_dtensor(local) and key != "step"
            and local.numel() == dtensor_params.local_of(param).numel()):
        local = dtensor_params.as_dtensor(local.view(dtensor_params.local_of(param).shape),
                                       param._spec)
    return local


def _local_part(key: str, value, info: ParamInfo, param: torch.Tensor):
    if dtensor_params.is_dtensor(value):
        return value.clone()
    where = f"optimizer state '{key}' of '{info.name}'"
    if isinstance(value, ShardedTensor):
        size = list(value.metadata().size)
        if size != [info.slot.numel]:
            raise ValueError(f"size mismatch for {where}: saved {size}, parameter has "
                             f"{info.slot.numel} elements")
        return local_part_of(value, *local_param_range(info.bucket, info.index), where).clone()
    # A full-form tensor of the parameter's shape is sharded; `step` and other scalars are not.
    if isinstance(value, torch.Tensor) and value.shape == info.slot.shape and key != "step":
        return info.bucket.layout.local_part(info.index, value).reshape(-1).to(param.device).clone()
    if (isinstance(value, torch.Tensor) and key != "step" and value.numel() > 1
            and value.numel() == info.slot.numel):  # the parameter's data, in another shape
        raise ValueError(f"size mismatch for {where}: saved {list(value.shape)}, parameter has "
                         f"shape {list(info.slot.shape)}")
    return value.clone() if isinstance(value, torch.Tensor) else value


def _match_groups(optimizer, infos, saved_groups: list[dict], index: dict[str, int]) -> list[dict]:
    """The saved groups in the optimizer's group order, with the optimizer's parameter indices."""
    owner = {}
    for i, group in enumerate(saved_groups):
        for name in group["params"]:
            owner[name] = i
    groups = []
    for group in optimizer.param_groups:
        names = [infos[id(p)].name for p in group["params"]]
        found = {owner.get(n) for n in names}
        if len(found) != 1 or None in found:
            missing = [n for n in names if n not in owner]
            raise ValueError(f"optimizer param group with {names[:3]}... does not match one saved "
                             f"group (not saved: {missing})")
        saved = saved_groups[found.pop()]
        if sorted(saved["params"]) != sorted(names):
            raise ValueError(f"saved param group {saved['params']} != optimizer's group {names}")
        groups.append({**saved, "params": [index[n] for n in names]})
    return groups
