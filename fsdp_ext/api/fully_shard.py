"""The public entry points, with PyTorch's names and meaning: `fully_shard` (FSDP2 style) and
`FullyShardedDataParallel` (FSDP1 style)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from ..diagnostics.input_checks import check_mesh_and_groups
from ..runtime import comm
from ..runtime.mixed_precision import MixedPrecisionPolicy
from ..runtime.offload import CPUOffloadPolicy
from ..runtime.registry import UNIT_ATTR, unit_of
from ..runtime.unit import Unit
from ..state.hooks import install_state_dict_hooks
from ..state.load_checks import load_problems
from .clip import clip_grad_norm_


def _device_for(module: nn.Module, mesh_device_type: str | None, offload: bool) -> torch.device:
    """The compute device: the mesh's type, else where the (non-meta) parameters are."""
    devices = {p.device for p in module.parameters() if not p.is_meta}
    if len(devices) > 1 and not offload:
        by_device = {}
        for name, p in module.named_parameters():
            by_device.setdefault(str(p.device), name)
        raise ValueError(f"{type(module).__name__} has parameters on several devices: "
                         + ", ".join(f"'{n}' on {d}" for d, n in by_device.items()))
    if mesh_device_type is not None:
        if mesh_device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(mesh_device_type)
    if torch.cuda.is_available() and (not devices or (offload and devices <= {torch.device("cpu")})):
        return torch.device("cuda", torch.cuda.current_device())
    return next(iter(devices)) if devices else torch.device("cpu")


def _groups_from(mesh, process_group, device: torch.device, reshard_after_forward) -> comm.Groups:
    shard = replicate = None
    if mesh is not None:
        if mesh.ndim == 1:
            shard = mesh.get_group(0)
        elif mesh.ndim == 2:
            replicate, shard = mesh.get_group(0), mesh.get_group(1)
        else:
            raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard); got {mesh.ndim}-D")
    elif isinstance(process_group, tuple):
        shard, replicate = process_group
    elif process_group is not None:
        shard = process_group
    elif dist.is_available() and dist.is_initialized():
        shard = dist.group.WORLD
    if shard is not None and dist.get_world_size(shard) == 1:
        shard = None
    if replicate is not None and dist.get_world_size(replicate) == 1:
        replicate = None
    groups = comm.Groups(device=device, shard=shard, replicate=replicate)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        k = reshard_after_forward
        if k < 1:
            raise ValueError(f"reshard_after_forward={k} must be >= 1")
        if 1 < k < groups.shard_size:
            groups.post_forward = comm.post_forward_group(shard, k)
            groups.post_forward_size = k
    return groups


class FSDPModule:
    """Mixed into every module passed to `fully_shard` (the module's class becomes a subclass)."""

    @property
    def _unit(self) -> Unit:
        return self.__dict__[UNIT_ATTR]

    def unshard(self, async_op: bool = False) -> None:
        self._unit.unshard(async_op)
        if not async_op:
            self._unit.wait_unshard()

    def reshard(self) -> None:
        self._unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        modules = self.modules() if recurse else [self]
        for module in modules:
            if (unit := unit_of(module)) is not None:
                unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        modules = self.modules() if recurse else [self]
        for module in modules:
            if (unit := unit_of(module)) is not None:
                unit.reshard_after_forward = reshard_after_forward

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip all sharded gradients under this module; returns the global norm (every rank)."""
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module's, after a check of every key (strict) and global shape that raises before
        anything is written: a failed load leaves the model as it was."""
        problems = load_problems(self, state_dict, strict)
        if problems:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t"
                               + "\n\t".join(problems))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _apply(self, *args, **kwargs):
        """nn.Module._apply (`to_empty`, `to`, ...) gives the modules new parameter tensors: the
        unit copies them into its shard (allocating it if it was on meta) and points them back."""
        self._unit.reshard()
        result = super()._apply(*args, **kwargs)
        self._unit.adopt_params()
        return result

    def set_prefetch_depth(self, forward: int | None = None, backward: int | None = None) -> None:
        """Prefetch depth for this root's schedule (fsdp_ext extension; default 1 and 1)."""
        if forward is not None:
            self._unit.options["forward_prefetch"] = forward
        if backward is not None:
            self._unit.options["backward_prefetch"] = backward
        if self._unit.schedule is not None:
            self._unit.schedule.options.update(self._unit.options)


def fully_shard(module: nn.Module, *, mesh=None, process_group=None,
                reshard_after_forward: bool | int | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: CPUOffloadPolicy | None = None, shard_placement_fn=None,
                param_init_fn=None, forward_prefetch: int = 1, backward_prefetch: int = 1,
                limit_in_flight: bool = True, collective_timeout: float | None = None,
                check_finite_grads: bool | None = None) -> nn.Module:
    """Shard `module`'s parameters (those not already owned by a sharded submodule) as one unit.

    Apply it bottom-up: to each block first, then to the model (the root). As with torch's
    fully_shard, each parameter becomes a DTensor parameter (Shard(0) on the mesh's shard
    dimension; Replicate() on the replicate dimension under HSDP) with the same name and global
    shape, whose local tensor is this rank's rows; build the optimizer afterwards. The module's
    class becomes a subclass of FSDPModule.

    Args:
        module: the module to shard; its parameters must all be on one device.
        mesh: a 1-D DeviceMesh (shard) or 2-D (replicate, shard) for HSDP. Default: the world.
        process_group: FSDP1-style alternative to `mesh`: a group, or (shard, replicate) groups.
        reshard_after_forward: True frees parameters after forward and regathers them in backward;
            False keeps them (ZeRO-2); an int k keeps 1/k of them and regathers from k ranks.
            None (default): True, except for the root, whose parameters backward needs first.
        mp_policy: mixed precision (param_dtype, reduce_dtype, output_dtype, cast_forward_inputs).
        offload_policy: CPUOffloadPolicy() keeps shards, gradients and optimizer state on the host.
        shard_placement_fn: torch's hook choosing a parameter's placement; Shard(0) (or None)
            is honoured, any other placement is refused naming the parameter.
        param_init_fn: fsdp_ext extension for modules built on the meta device: called on each
            module of the unit once its parameters have storage. Without it, parameters on meta
            stay there until `model.to_empty(device=...)`, as with torch's fully_shard.
        forward_prefetch / backward_prefetch: how many units ahead to all-gather (read by the root).
        limit_in_flight: keep at most max(depth) + 1 transient units unsharded.
        collective_timeout: seconds a rank waits on one of this root's collectives before raising
            CollectiveError naming the unit (read by the root; default: the environment variable
            FSDP_EXT_COLLECTIVE_TIMEOUT_S, else only the process group's timeout).
        check_finite_grads: raise NonFiniteGradientError naming the unit, parameter and rank as
            soon as a NaN/Inf gradient reaches this unit's reduce-scatter (one extra tiny
            all-reduce per bucket; default: FSDP_EXT_CHECK_FINITE_GRADS=1, else off).
    """
    _check_placements(module, shard_placement_fn)
    return shard_module(
        module, layout="rows", mesh=mesh, process_group=process_group,
        reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
        offload_policy=offload_policy, param_init_fn=param_init_fn,
        forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch,
        limit_in_flight=limit_in_flight, collective_timeout=collective_timeout,
        check_finite_grads=check_finite_grads)


def _check_placements(module: nn.Module, shard_placement_fn) -> None:
    """Only Shard(0) is implemented: refuse any other placement before anything changes."""
    if shard_placement_fn is None:
        return
    for name, param in module.named_parameters():
        placement = shard_placement_fn(param)
        if placement is not None and not (isinstance(placement, Shard) and placement.dim in (
                0, -param.dim())):
            raise NotImplementedError(
                f"fully_shard({type(module).__name__}): shard_placement_fn returned {placement} "
                f"for parameter '{name}'; fsdp_ext shards along dim 0 only (Shard(0), or None)")


def shard_module(module: nn.Module, *, layout: str, mesh=None, process_group=None,
                 reshard_after_forward: bool | int | None = None,
                 mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                 offload_policy: CPUOffloadPolicy | None = None, param_init_fn=None,
                 forward_prefetch: int = 1, backward_prefetch: int = 1,
                 limit_in_flight: bool = True, collective_timeout: float | None = None,
                 check_finite_grads: bool | None = None,
                 direct_min_numel: int | None = None) -> nn.Module:
    """fully_shard's work, for both public APIs: `layout` "rows" (fully_shard: DTensor
    parameters) or "flat" (FullyShardedDataParallel: FSDP1's flat views). `direct_min_numel`
    (rows: which parameters are gathered directly, runtime/layout.py) is for benchmarks."""
    if unit_of(module) is not None:
        raise ValueError(f"{type(module).__name__} is already sharded by fully_shard")
    for name, sub in module.named_modules():
        if name and (sub_unit := unit_of(sub)) is not None and sub_unit.schedule is not None:
            raise ValueError(f"submodule '{name}' already ran forward; shard before the first forward")
    device = _device_for(module, mesh.device_type if mesh is not None else None,
                         offload_policy is not None)
    if (device.type != "cpu" and offload_policy is None
            and any(p.device != device and not p.is_meta for p in module.parameters())):
        module.to(device)
    if offload_policy is not None and device.type != "cpu":  # shards stay on the host, buffers move
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None:
                    sub._buffers[name] = buf.to(device)
    check_mesh_and_groups(module, mesh, process_group)
    groups = _groups_from(mesh, process_group, device, reshard_after_forward)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        # As in FSDP2: k == 1 keeps everything (False); k >= shard size is a full reshard (True).
        reshard_after_forward = reshard_after_forward > 1
    if check_finite_grads is None:
        check_finite_grads = os.environ.get("FSDP_EXT_CHECK_FINITE_GRADS", "0") not in ("", "0")
    options = dict(forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch,
                   limit_in_flight=limit_in_flight, collective_timeout=collective_timeout,
                   check_finite_grads=check_finite_grads, direct_min_numel=direct_min_numel)
    unit = Unit(module, groups, mp_policy, reshard_after_forward, options, offload_policy,
                param_init_fn, layout=layout, mesh=mesh)
    module.__dict__[UNIT_ATTR] = unit
    install_state_dict_hooks(module)
    cls = module.__class__
    if not isinstance(module, FSDPModule):
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return module
