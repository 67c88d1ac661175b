"""FSDP1's state-dict settings and its optimizer state-dict family, on fsdp_ext's name-keyed forms.

`state_dict_type` takes torch's `StateDictType` with its configs: FULL_STATE_DICT
(FullStateDictConfig: offload_to_cpu, rank0_only) and SHARDED_STATE_DICT (ShardedStateDictConfig:
offload_to_cpu), and the optimizer's (FullOptimStateDictConfig, ShardedOptimStateDictConfig).
torch's defaults hold: a FullyShardedDataParallel model's state_dict() is full, its optimizer
state dict full and moved to the CPU. LOCAL_STATE_DICT (FSDP1's FlatParameters) is refused.

The legacy functions (full_optim_state_dict, rekey_optim_state_dict, ...) key by parameter names,
as torch 2.14's do; rekey_optim_state_dict converts to parameter IDs (OptimStateKeyType.PARAM_ID:
positions in the optimizer's param_groups, those of the unwrapped model's optimizer) and back,
and the loading functions take either.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig,
                                    OptimStateKeyType, ShardedOptimStateDictConfig,
                                    ShardedStateDictConfig, StateDictSettings, StateDictType)

from ..runtime.core.registry import units_of
from ..state import state_dict as _sd
from ..state.load_optim_state_dict import to_local_optim_state_dict
from ..state.optim_state_dict import optim_state_dict as _optim_state_dict
from .options import _member

TORCH_SETTINGS_ATTR = "_fsdp_ext_torch_state_dict_settings"
_CONFIGS = {"FULL_STATE_DICT": (FullStateDictConfig, FullOptimStateDictConfig),
            "SHARDED_STATE_DICT": (ShardedStateDictConfig, ShardedOptimStateDictConfig)}


def set_type(model: nn.Module, state_dict_type, state_dict_config=None,
             optim_state_dict_config=None) -> StateDictSettings:
    """Set every unit's state-dict type; returns the previous settings (torch's dataclass)."""
    kind = _member(state_dict_type, StateDictType, "state_dict_type")
    if kind.name == "LOCAL_STATE_DICT":
        raise NotImplementedError(
            "StateDictType.LOCAL_STATE_DICT returns FSDP1's FlatParameters, which fsdp_ext does not "
            "have; use SHARDED_STATE_DICT (any world size can load it) or FULL_STATE_DICT")
    config_cls, optim_cls = _CONFIGS[kind.name]
    config = state_dict_config if state_dict_config is not None else config_cls()
    optim_config = optim_state_dict_config if optim_state_dict_config is not None else optim_cls()
    for given, expected in ((config, config_cls), (optim_config, optim_cls)):
        if type(given) is not expected:
            raise ValueError(f"{kind.name} expects a {expected.__name__}, got {type(given).__name__}")
    if getattr(config, "_use_dtensor", False) or getattr(optim_config, "_use_dtensor", False):
        raise NotImplementedError("ShardedStateDictConfig(_use_dtensor=True) is not supported; "
                                  "fully_shard models give DTensor state dicts")
    full = kind.name == "FULL_STATE_DICT"
    previous = get_type(model)
    settings = _sd.StateDictSettings(full=full, rank0_only=getattr(config, "rank0_only", False),
                                     cpu_offload=config.offload_to_cpu)
    optim = _sd.StateDictSettings(full=full, rank0_only=getattr(optim_config, "rank0_only", False),
                                  cpu_offload=optim_config.offload_to_cpu)
    _sd.set_state_dict_settings(model, settings, optim)
    for unit in units_of(model):
        setattr(unit, TORCH_SETTINGS_ATTR, StateDictSettings(kind, config, optim_config))
    return previous


def get_type(model: nn.Module) -> StateDictSettings:
    """The settings every unit under `model` shares (torch raises when they differ; so does this)."""
    found = {id(s): s for u in units_of(model)
             if (s := getattr(u, TORCH_SETTINGS_ATTR, None)) is not None}
    if len(found) > 1 and len({(s.state_dict_type, type(s.state_dict_config)) for s in
                               found.values()}) > 1:
        raise AssertionError("all FSDP modules must have the same state_dict settings")
    if not found:
        return StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                 FullOptimStateDictConfig())
    return next(iter(found.values()))


def refuse_group(group, method: str) -> None:
    if group is not None and group is not dist.group.WORLD:
        raise NotImplementedError(f"{method}(group=...): fsdp_ext uses the model's own groups; "
                                  "leave group=None")


def optim_state_dict(model: nn.Module, optim) -> dict:
    units = units_of(model)
    settings = _sd.optim_settings_of(units[0]) if units else _sd.StateDictSettings()
    return _optim_state_dict(model, optim, full=settings.full, rank0_only=settings.rank0_only,
                             cpu_offload=settings.cpu_offload)


def to_load(model: nn.Module, optim, osd: dict | None) -> dict:
    """The loadable local dict; with rank0_only full settings, rank 0's dict reaches every rank."""
    units = units_of(model)
    settings = _sd.optim_settings_of(units[0]) if units else _sd.StateDictSettings()
    if settings.full and settings.rank0_only and dist.is_initialized():
        holder = [osd if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        osd = holder[0]
    return to_local_optim_state_dict(model, optim, osd)


# ---- the legacy functions -------------------------------------------------------------------------
def _refuse_optim_input(optim_input, method: str) -> None:
    if optim_input is not None:
        raise NotImplementedError(f"{method}(optim_input=...) is deprecated in torch; pass optim=")


def _param_order(model: nn.Module, optim) -> list[str]:
    """Parameter names in ID order: the optimizer's param_groups order, else the model's."""
    names = {id(p): n for n, p in model.named_parameters()}
    if optim is None:
        return list(names.values())
    return [names[id(p)] for g in optim.param_groups for p in g["params"]]


def _to_ids(osd: dict, order: list[str]) -> dict:
    ids = {name: i for i, name in enumerate(order)}
    return {"state": {ids[n]: v for n, v in osd["state"].items()},
            "param_groups": [{**g, "params": [ids[n] for n in g["params"]]}
                             for g in osd["param_groups"]]}


def _to_names(osd: dict, order: list[str]) -> dict:
    def name(key):
        return order[key] if isinstance(key, int) else key
    return {"state": {name(k): v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [name(k) for k in g["params"]]}
                             for g in osd["param_groups"]]}


def full_optim_state_dict(model: nn.Module, optim, optim_input=None, rank0_only: bool = True,
                          group=None) -> dict:
    """The full optimizer state keyed by parameter names, as torch's returns it (tensors on the
    CPU; rekey_optim_state_dict gives IDs); with rank0_only, other ranks get {}."""
    _refuse_optim_input(optim_input, "full_optim_state_dict")
    refuse_group(group, "full_optim_state_dict")
    return _optim_state_dict(_unwrapped(model), optim, full=True, rank0_only=rank0_only,
                             cpu_offload=True)


def sharded_optim_state_dict(model: nn.Module, optim, group=None) -> dict:
    """The sharded form, keyed by parameter names (torch.distributed.checkpoint saves it)."""
    refuse_group(group, "sharded_optim_state_dict")
    return _optim_state_dict(_unwrapped(model), optim, full=False)


def shard_full_optim_state_dict(full_optim_state_dict: dict, model: nn.Module, optim_input=None,
                                optim=None) -> dict:
    """A full optimizer state dict (ID- or name-keyed) as this rank's `optim.load_state_dict`
    input."""
    _refuse_optim_input(optim_input, "shard_full_optim_state_dict")
    if optim is None:
        raise ValueError("shard_full_optim_state_dict needs optim= (the optimizer that loads it)")
    model = _unwrapped(model)
    named = _to_names(full_optim_state_dict, _param_order(model, optim))
    return to_local_optim_state_dict(model, optim, named)


def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict, model: nn.Module,
                                     optim) -> dict:
    return to_local_optim_state_dict(_unwrapped(model), optim, sharded_optim_state_dict)


def scatter_full_optim_state_dict(full_optim_state_dict: dict | None, model: nn.Module,
                                  optim_input=None, optim=None, group=None) -> dict:
    """Rank 0's full optimizer state dict (others pass None) as every rank's loadable dict."""
    _refuse_optim_input(optim_input, "scatter_full_optim_state_dict")
    refuse_group(group, "scatter_full_optim_state_dict")
    holder = [full_optim_state_dict if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return shard_full_optim_state_dict(holder[0], model, optim=optim)


def rekey_optim_state_dict(optim_state_dict: dict, optim_state_key_type, model: nn.Module,
                           optim_input=None, optim=None) -> dict:
    """Re-key a full or sharded optimizer state dict by parameter names or IDs."""
    _refuse_optim_input(optim_input, "rekey_optim_state_dict")
    kind = _member(optim_state_key_type, OptimStateKeyType, "optim_state_key_type")
    order = _param_order(_unwrapped(model), optim)
    named = _to_names(optim_state_dict, order)
    return named if kind.name == "PARAM_NAME" else _to_ids(named, order)


def _unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "_fsdp_wrapped_module", model)

