"""`FullyShardedDataParallel`: the FSDP1-style wrapper, built on the same units as `fully_shard`.

Unlike FSDP1, auto-wrapping does not replace submodules with wrapper objects: the selected
submodules become units in place, so the model's structure, parameter names and state-dict keys stay
exactly those of the unwrapped model (the wrapper itself adds no prefix).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.offload import CPUOffloadPolicy
from ..runtime.registry import units_of
from ..state import state_dict as _sd
from ..state.load_optim_state_dict import to_local_optim_state_dict
from ..state.optim_state_dict import optim_state_dict
from ..state.summon import summon_full_params
from .clip import clip_grad_norm_
from .fsdp1_config import BackwardPrefetch, MixedPrecision, ShardingStrategy
from .fully_shard import FSDPModule, shard_module
from .wrap import apply_auto_wrap


def _hybrid_mesh(device_type: str):
    """(replicate, shard) mesh: shard within a node (LOCAL_WORLD_SIZE ranks), replicate across."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(f"HYBRID_SHARD: world size {world} is not a multiple of LOCAL_WORLD_SIZE {local}")
    return init_device_mesh(device_type, (world // local, local), mesh_dim_names=("replicate", "shard"))


class FullyShardedDataParallel(nn.Module):
    """Drop-in for torch.distributed.fsdp.FullyShardedDataParallel (see docs/api.md for differences)."""

    def __init__(self, module: nn.Module, process_group=None,
                 sharding_strategy: ShardingStrategy | None = None, cpu_offload=None,
                 auto_wrap_policy=None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, ignored_modules=None,
                 param_init_fn=None, device_id=None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = True, ignored_states=None, device_mesh=None):
        super().__init__()
        if ignored_modules or ignored_states:
            raise NotImplementedError("ignored_modules / ignored_states are not supported")
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        if device_id is not None:
            device = torch.device(device_id) if not isinstance(device_id, int) else torch.device(
                "cuda", device_id)
            module.to(device)
        devices = {p.device.type for p in module.parameters()} - {"meta"}
        device_type = devices.pop() if devices else ("cuda" if torch.cuda.is_available() else "cpu")
        mesh, group = device_mesh, process_group
        if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
            if mesh is None and not isinstance(group, tuple):
                mesh = _hybrid_mesh(device_type)
        elif strategy is ShardingStrategy.NO_SHARD:
            group = (None, group or dist.group.WORLD)
        if sync_module_states:  # start every rank from rank 0's values, as FSDP1 does
            with torch.no_grad():
                for tensor in list(module.parameters()) + list(module.buffers()):
                    if not tensor.is_meta:
                        dist.broadcast(tensor.data, src=0)
        mp = mixed_precision or MixedPrecision()
        if mp.buffer_dtype is not None:
            for buf in module.buffers():
                if torch.is_floating_point(buf):
                    buf.data = buf.data.to(mp.buffer_dtype)
        reshard = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
        offload = CPUOffloadPolicy() if getattr(cpu_offload, "offload_params", False) else None
        kwargs = dict(mesh=mesh, process_group=group, offload_policy=offload,
                      param_init_fn=param_init_fn,
                      forward_prefetch=1 if forward_prefetch else 0,
                      backward_prefetch=0 if backward_prefetch is None else 1,
                      limit_in_flight=limit_all_gathers)
        if auto_wrap_policy is not None:
            apply_auto_wrap(module, auto_wrap_policy, lambda m: shard_module(
                m, layout="flat", reshard_after_forward=reshard, mp_policy=mp.to_policy(False),
                **kwargs))
        shard_module(module, layout="flat", reshard_after_forward=None if reshard else False,
                     mp_policy=mp.to_policy(True), **kwargs)
        module._unit.options["backward_prefetch_at"] = (
            "post" if backward_prefetch is BackwardPrefetch.BACKWARD_POST else "pre")
        self._fsdp_wrapped_module = module

    @property
    def module(self) -> nn.Module:
        return self._fsdp_wrapped_module

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fsdp_wrapped_module, name)

    # The wrapper is transparent: names and keys are those of the wrapped module.
    def named_parameters(self, *args, **kwargs):
        return self._fsdp_wrapped_module.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self._fsdp_wrapped_module.named_buffers(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self._fsdp_wrapped_module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._fsdp_wrapped_module.load_state_dict(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip all sharded gradients; returns the true global norm, the same on every rank."""
        return clip_grad_norm_(self._fsdp_wrapped_module, max_norm, norm_type, error_if_nonfinite)

    @staticmethod
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           **unused):
        """Full parameters in place inside the block (see fsdp_ext.summon_full_params)."""
        target = module._fsdp_wrapped_module if isinstance(module, FullyShardedDataParallel) else module
        return summon_full_params(target, writeback=writeback)

    # ---- state dicts (torch's StateDictType and configs are accepted as they are) ----------------
    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type, state_dict_config=None,
                        optim_state_dict_config=None):
        """Inside the block, `module.state_dict()` (and optim_state_dict) return this type."""
        with _sd.state_dict_settings(
                _unwrap(module), _sd.settings_for(state_dict_type, state_dict_config),
                _sd.settings_for(state_dict_type, optim_state_dict_config)):
            yield

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type, state_dict_config=None,
                            optim_state_dict_config=None) -> None:
        _sd.set_state_dict_settings(
            _unwrap(module), _sd.settings_for(state_dict_type, state_dict_config),
            _sd.settings_for(state_dict_type, optim_state_dict_config))

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, **unused) -> dict:
        """Name-keyed optimizer state, full or sharded as set by state_dict_type (default sharded)."""
        units = units_of(_unwrap(model))
        settings = _sd.optim_settings_of(units[0]) if units else _sd.StateDictSettings()
        return optim_state_dict(_unwrap(model), optim, full=settings.full,
                                rank0_only=settings.rank0_only, cpu_offload=settings.cpu_offload)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                                 optim_state_dict: dict, **unused) -> dict:
        """The name-keyed dict as this rank's `optim.load_state_dict` input (full or sharded)."""
        return to_local_optim_state_dict(_unwrap(model), optim, optim_state_dict)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (unsharded) and skip communication inside the block."""
        root: FSDPModule = self._fsdp_wrapped_module
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)


def _unwrap(module: nn.Module) -> nn.Module:
    return module._fsdp_wrapped_module if isinstance(module, FullyShardedDataParallel) else module
