"""`FullyShardedDataParallel`: the FSDP1-style wrapper, built on the same units as `fully_shard`.

Unlike FSDP1, auto-wrapping does not replace submodules with wrapper objects: the selected
submodules become units in place, so the model's structure, parameter names and state-dict keys stay
exactly those of the unwrapped model (the wrapper itself adds no prefix). Its arguments are torch's
own option objects, read by meaning (options.py); its static methods are FSDP1's (fsdp1_state.py
holds the optimizer state-dict family).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, MixedPrecision,
                                    StateDictSettings, StateDictType)

from .. import env
from ..runtime.core.registry import unit_of, units_of
from ..runtime.unit.schedule_options import ScheduleOptions
from ..runtime.unit.config import UnitOptions
from ..runtime.unit.states import TrainingState as UnitState
from ..state import state_dict as _sd
from ..state.summon import summon_full_params
from . import default_group, fsdp1_state, options
from .clip import clip_grad_norm_
from .fully_shard import shard_module
from .wrap import apply_auto_wrap


def _hybrid_mesh(device_type: str):
    """(replicate, shard) mesh: shard within a node (LOCAL_WORLD_SIZE ranks), replicate across."""
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    local = env.local_world_size(world)
    if world % local:
        raise ValueError(f"HYBRID_SHARD: world size {world} is not a multiple of LOCAL_WORLD_SIZE {local}")
    return init_device_mesh(device_type, (world // local, local), mesh_dim_names=("replicate", "shard"))


def _ignored(module: nn.Module, ignored_modules, ignored_states) -> tuple[set, set]:
    """(ignored modules, ignored parameters): FSDP1 leaves their parameters unsharded."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("pass ignored_modules or ignored_states, not both (as in torch)")
    states = list(ignored_modules or ignored_states or ())
    if any(isinstance(s, nn.Parameter) for s in states) and not all(
            isinstance(s, nn.Parameter) for s in states):
        raise ValueError("ignored_states must be all parameters or all modules")
    modules = {m for s in states if isinstance(s, nn.Module) for m in s.modules()}
    params = {p for s in states if isinstance(s, nn.Parameter) for p in [s]}
    params |= {p for m in modules for p in m.parameters()}
    if module in modules:
        raise ValueError("the module given to FullyShardedDataParallel cannot be ignored")
    return modules, params


_WRAPPED_PREFIX = "_fsdp_wrapped_module."  # where the wrapper keeps the model (torch's name)

class FullyShardedDataParallel(nn.Module):
    """Drop-in for torch.distributed.fsdp.FullyShardedDataParallel (see docs/compat.md)."""

    def __init__(self, module: nn.Module, process_group=None, sharding_strategy=None,
                 cpu_offload: CPUOffload | None = None, auto_wrap_policy=None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, ignored_modules=None,
                 param_init_fn=None, device_id=None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = False, ignored_states=None, device_mesh=None,
                 comm_policy=None):
        super().__init__()
        if process_group is None and device_mesh is None:
            default_group.ensure_for_fsdp1()
        strategy = options.sharding_strategy(sharding_strategy)
        prefetch_at = options.backward_prefetch(backward_prefetch)
        offload = options.cpu_offload(cpu_offload)
        options.mixed_precision(mixed_precision, True)  # refuses what cannot be honoured, now
        skipped_modules, skipped_params = _ignored(module, ignored_modules, ignored_states)
        if device_id is not None:
            device = torch.device(device_id) if not isinstance(device_id, int) else torch.device(
                "cuda", device_id)
            module.to(device)
        devices = {p.device.type for p in module.parameters()} - {"meta"}
        device_type = devices.pop() if devices else ("cuda" if torch.cuda.is_available() else "cpu")
        mesh, group = device_mesh, process_group
        if strategy.hybrid:
            if mesh is None and not isinstance(group, tuple):
                mesh = _hybrid_mesh(device_type)
        elif not strategy.shard:
            group = (None, group or dist.group.WORLD)
        if sync_module_states:  # start every rank from rank 0's values, as FSDP1 does
            with torch.no_grad():
                for tensor in list(module.parameters()) + list(module.buffers()):
                    if not tensor.is_meta and tensor not in skipped_params:
                        dist.broadcast(tensor.data, src=0)
        if mixed_precision is not None and mixed_precision.buffer_dtype is not None:
            for buf in module.buffers():
                if torch.is_floating_point(buf):
                    buf.data = buf.data.to(mixed_precision.buffer_dtype)

        def shard(unit_module: nn.Module, reshard_after_forward, mp, unit_offload) -> nn.Module:
            return shard_module(unit_module, mesh=mesh, process_group=group, options=UnitOptions(
                mp=mp, layout="flat", reshard_after_forward=reshard_after_forward,
                offload=unit_offload, comm_policy=comm_policy, param_init_fn=param_init_fn,
                ignored_params=frozenset(id(p) for p in skipped_params),
                schedule=ScheduleOptions(forward_prefetch=1 if forward_prefetch else 0,
                                         backward_prefetch=0 if prefetch_at is None else 1,
                                         backward_prefetch_at=prefetch_at or "pre",
                                         limit_in_flight=limit_all_gathers)))
        root_kwargs = dict(sharding_strategy=sharding_strategy, cpu_offload=cpu_offload,
                           mixed_precision=mixed_precision)

        def shard_unit(unit_module: nn.Module, **overrides) -> nn.Module:
            """One unit chosen by the auto-wrap policy, with its own overrides (CustomPolicy)."""
            kwargs = {**root_kwargs, **overrides}
            unit_strategy = options.sharding_strategy(kwargs.pop("sharding_strategy"))
            unit_offload = options.cpu_offload(kwargs.pop("cpu_offload"))
            mp = options.mixed_precision(kwargs.pop("mixed_precision"), False)
            if kwargs:
                raise NotImplementedError(
                    f"auto_wrap_policy: per-module arguments {sorted(kwargs)} for "
                    f"{type(unit_module).__name__} are not supported (sharding_strategy, "
                    "cpu_offload and mixed_precision are)")
            return shard(unit_module, unit_strategy.reshard_after_forward, mp, unit_offload)

        if auto_wrap_policy is not None:
            apply_auto_wrap(module, auto_wrap_policy, shard_unit, skipped_modules,
                            skipped_params, root_kwargs)
        shard(module, None if strategy.reshard_after_forward else False,
              options.mixed_precision(mixed_precision, True), offload)
        self._fsdp_wrapped_module = module
        # torch's FSDP1 defaults: full state dicts, the optimizer's moved to the CPU
        fsdp1_state.set_type(module, StateDictType.FULL_STATE_DICT)
        # FSDP1's public attributes
        self.sharding_strategy = options._member(
            sharding_strategy or options.ShardingStrategy.FULL_SHARD, options.ShardingStrategy,
            "sharding_strategy")
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.cpu_offload = cpu_offload or CPUOffload()
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        groups = module._unit.groups
        self.process_group = groups.shard if groups.shard is not None else (
            groups.replicate or (dist.group.WORLD if dist.is_initialized() else None))
        self.rank = dist.get_rank(self.process_group) if self.process_group is not None else 0
        self.world_size = (dist.get_world_size(self.process_group)
                           if self.process_group is not None else 1)
        self.compute_device = groups.device

    @property
    def module(self) -> nn.Module:
        return self._fsdp_wrapped_module

    @property
    def params(self):
        raise NotImplementedError(
            "FullyShardedDataParallel.params lists FSDP1's FlatParameters; fsdp_ext keeps the "
            "original parameters (their .data views this rank's shard): use .parameters()")

    @property
    def training_state(self):
        from torch.distributed.fsdp._common_utils import TrainingState
        unit = self._fsdp_wrapped_module._unit
        if unit.training_state is UnitState.SUMMONED:
            return TrainingState.SUMMON_FULL_PARAMS
        schedule = unit.schedule
        if schedule is not None and schedule.running():
            return TrainingState.FORWARD_BACKWARD
        return TrainingState.IDLE

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fsdp_wrapped_module, name)

    # The wrapper is transparent: names and keys are those of the unwrapped model, also under
    # wrappers nested by hand (torch's FSDP1 cleans names so only inside summon_full_params).
    def named_parameters(self, *args, **kwargs):
        for name, param in self._fsdp_wrapped_module.named_parameters(*args, **kwargs):
            yield name.replace(_WRAPPED_PREFIX, ""), param

    def named_buffers(self, *args, **kwargs):
        for name, buffer in self._fsdp_wrapped_module.named_buffers(*args, **kwargs):
            yield name.replace(_WRAPPED_PREFIX, ""), buffer

    def state_dict(self, *args, **kwargs):
        return self._fsdp_wrapped_module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._fsdp_wrapped_module.load_state_dict(*args, **kwargs)

    def check_is_root(self) -> bool:
        unit = self._fsdp_wrapped_module._unit
        if unit.schedule is not None and not unit.schedule.standalone:
            return unit.is_root
        return True  # the outermost wrapper becomes the root at its first forward

    def apply(self, fn):
        """nn.Module.apply with the full parameters in place (edits are kept), as FSDP1's."""
        with summon_full_params(self._fsdp_wrapped_module, writeback=True):
            return super().apply(fn)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip all sharded gradients; returns the true global norm, the same on every rank."""
        return clip_grad_norm_(self._fsdp_wrapped_module, max_norm, norm_type, error_if_nonfinite)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (unsharded) and skip communication inside the block."""
        root = self._fsdp_wrapped_module
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    def register_comm_hook(self, state: object, hook: callable) -> None:
        raise NotImplementedError(
            "register_comm_hook: fsdp_ext reduces gradients with its own fused pack / reduce-"
            "scatter / epilogue kernels and takes no FSDP1 communication hooks; "
            "set_all_reduce_hook on a fully_shard module can post-process reduced gradients")

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[nn.Module]:
        """The sharded modules under `module` (the wrapper stands for its wrapped module)."""
        found, seen = [], set()
        for sub in module.modules():
            target = sub._fsdp_wrapped_module if isinstance(sub, FullyShardedDataParallel) else sub
            unit = unit_of(target)
            if unit is None or id(unit) in seen:
                continue
            seen.add(id(unit))
            found.append(sub)
        if root_only:
            inner = {id(u) for m in found for u in units_of(_unwrap(m)) if u is not unit_of(_unwrap(m))}
            found = [m for m in found if id(unit_of(_unwrap(m))) not in inner]
        return found

    @staticmethod
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False):
        """Full parameters in place inside the block (see fsdp_ext.summon_full_params)."""
        return summon_full_params(_unwrap(module), recurse=recurse, writeback=writeback,
                                  rank0_only=rank0_only, offload_to_cpu=offload_to_cpu,
                                  with_grads=with_grads)

    # ---- state dicts: torch's StateDictType and configs, as they are ----------------------------------
    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                        optim_state_dict_config=None):
        """Inside the block, `module.state_dict()` (and optim_state_dict) return this type."""
        previous = fsdp1_state.set_type(_unwrap(module), state_dict_type, state_dict_config,
                                        optim_state_dict_config)
        try:
            yield
        finally:
            fsdp1_state.set_type(_unwrap(module), previous.state_dict_type,
                                 previous.state_dict_config, previous.optim_state_dict_config)

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                            state_dict_config=None, optim_state_dict_config=None) -> StateDictSettings:
        return fsdp1_state.set_type(_unwrap(module), state_dict_type, state_dict_config,
                                    optim_state_dict_config)

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        return fsdp1_state.get_type(_unwrap(module))

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: dict | None = None, group=None) -> dict:
        """Name-keyed optimizer state, full or sharded as set by state_dict_type."""
        fsdp1_state.refuse_group(group, "optim_state_dict")
        if optim_state_dict is not None:
            raise NotImplementedError(
                "optim_state_dict(optim_state_dict=...): fsdp_ext reads the optimizer's own state; "
                "call it without that argument")
        return fsdp1_state.optim_state_dict(_unwrap(model), optim)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                                 optim_state_dict: dict, is_named_optimizer: bool = False,
                                 load_directly: bool = False, group=None) -> dict:
        """The name-keyed dict as this rank's `optim.load_state_dict` input (loaded into `optim`
        too with load_directly=True)."""
        fsdp1_state.refuse_group(group, "optim_state_dict_to_load")
        if is_named_optimizer:
            raise NotImplementedError("optim_state_dict_to_load(is_named_optimizer=True): "
                                      "torchrec's named optimizers are not supported")
        result = fsdp1_state.to_load(_unwrap(model), optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(result)
        return result

    full_optim_state_dict = staticmethod(fsdp1_state.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(fsdp1_state.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(fsdp1_state.shard_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(fsdp1_state.flatten_sharded_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(fsdp1_state.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(fsdp1_state.rekey_optim_state_dict)


def _unwrap(module: nn.Module) -> nn.Module:
    return module._fsdp_wrapped_module if isinstance(module, FullyShardedDataParallel) else module
