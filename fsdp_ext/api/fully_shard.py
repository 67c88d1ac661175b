"""`fully_shard` (FSDP2 style), and `shard_module`, the work behind it and behind
`FullyShardedDataParallel` (FSDP1 style, fsdp1.py)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from ..diagnostics.input_checks import check_mesh_and_groups
from ..diagnostics.optim_check import install_step_check
from .. import env
from ..runtime.comm import collectives as comm, process_groups
from ..runtime.core import storage_cache, streams
from ..runtime.wire.comm_policy import check_policy
from ..runtime.core.registry import UNIT_ATTR, name_replaced_from, unit_of
from . import pipelining
from ..runtime.unit.schedule_options import ScheduleOptions
from ..runtime.unit.list_unit import ListUnit
from ..runtime.unit.unit import Unit
from ..runtime.unit.config import UnitConfig, UnitOptions
from ..state.hooks import install_state_dict_hooks
from . import default_group, options
from .dp_mesh_dims import data_parallel_mesh
from .fsdp_module import FSDPModule
from .options import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

_FSDP_CLASSES: dict[type, type] = {}  # one FSDP<Orig> class per original class, as torch keeps


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
    """The unit's groups; a post-forward group (`reshard_after_forward=k`) is only checked here,
    and made at the root's first forward, under the root's collective_timeout
    (process_groups.make_first_forward_groups)."""
    shard = replicate = None
    if mesh is not None:
        of_mesh = comm.Groups.of_mesh(mesh, device)
        shard, replicate = of_mesh.shard, of_mesh.replicate
    elif isinstance(process_group, tuple):
        shard, replicate = process_group
    elif process_group is not None:
        shard = process_group
    elif dist.is_available() and dist.is_initialized():
        shard = dist.group.WORLD
    single_process = not (dist.is_available() and dist.is_initialized())  # (a mesh needs one)
    k, requested = 1, 1
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        if reshard_after_forward < 1:
            raise ValueError(f"reshard_after_forward={reshard_after_forward} must be >= 1")
        requested = reshard_after_forward
        if 1 < reshard_after_forward < (dist.get_world_size(shard) if shard is not None else 1):
            k = reshard_after_forward
            process_groups.check_post_forward(shard, k)
    return comm.Groups.over(device, shard, replicate, post_forward_size=k,
                            requested_post_forward=requested,
                            single_process=single_process)


def fully_shard(module: nn.Module | list[nn.Module], *, mesh=None,
                reshard_after_forward: bool | int | None = None,
                shard_placement_fn=None, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(), ignored_params=None,
                dp_mesh_dims=None, process_group=None, param_init_fn=None,
                forward_prefetch: int = 1, backward_prefetch: int = 1, limit_in_flight: bool = True,
                collective_timeout: float | None = None,
                check_finite_grads: bool | None = None, comm_policy=None) -> nn.Module:
    """Shard `module`'s parameters (those not already owned by a sharded submodule) as one unit;
    a list of modules is one unit (one all-gather and one reduce-scatter for all of them), as in
    torch. Returns its argument.

    Apply it bottom-up: to each block first, then to the model (the root). As with torch's
    fully_shard, each parameter becomes a DTensor parameter (Shard(0) on the mesh's shard
    dimension; Replicate() on the replicate dimension under HSDP) with the same name and global
    shape, whose local tensor is this rank's rows; build the optimizer afterwards. The module's
    class becomes a subclass of FSDPModule.

    Args:
        module: the module to shard, or a list of modules (none inside another) to shard
            together; their parameters must all be on one device.
        mesh: a 1-D DeviceMesh (shard) or 2-D (replicate, shard) for HSDP. Default: the world;
            under a launcher (torchrun) with no process group yet, the default group is
            initialised from the environment, as torch's fully_shard does. In a plain `python`
            process with no group: one process, nothing sharded, said at the first forward
            (api/default_group.py).
        process_group: FSDP1-style alternative to `mesh`: a group, or (shard, replicate) groups.
        reshard_after_forward: True frees parameters after forward and regathers them in backward;
            False keeps them (ZeRO-2); an int k keeps 1/k of them and regathers from k ranks.
            None (default): True, except for the root, whose parameters backward needs first.
        mp_policy: torch's MixedPrecisionPolicy (param_dtype, reduce_dtype, output_dtype,
            cast_forward_inputs).
        offload_policy: torch's OffloadPolicy() (none) or CPUOffloadPolicy(pin_memory=...): shards,
            gradients and optimizer state on the host.
        shard_placement_fn: torch's hook choosing a parameter's placement: Shard(dim) for any
            dim of the parameter (uneven sizes padded), None for Shard(0), or a mesh of its own
            (torch's ShardPlacementResult with an FSDPMeshInfo or HSDPMeshInfo, or fsdp_ext's
            MeshPlacement), as expert parallelism gives its experts (runtime/placement/shard_fn.py).
        ignored_params: parameters left alone: not sharded, not moved, gradients not reduced.
        dp_mesh_dims: torch's DataParallelMeshDims: `mesh` is then the whole SPMD mesh and these
            its data-parallel axes (several shard axes flattened into one; a replicate axis makes
            it HSDP; replicate alone, replicate-only), as torch's. Another axis of more than one
            rank (tensor or expert parallelism) is what a parameter's DTensor placements or
            spmd_types annotation say it holds there; a plain parameter without one is refused
            naming it (api/dp_mesh_dims.py, runtime/placement/spmd_params.py).
        param_init_fn: fsdp_ext extension for modules built on the meta device: called on each
            module of the unit once its parameters have storage. Without it, parameters on meta
            stay there until `model.to_empty(device=...)`, as with torch's fully_shard.
        forward_prefetch / backward_prefetch: how many units ahead to all-gather (read by the root).
        limit_in_flight: keep at most max(depth) + 1 transient units unsharded.
        collective_timeout: seconds a rank waits on one of this root's collectives before raising
            CollectiveError naming the unit (read by the root, for its whole model; default:
            the environment variable FSDP_EXT_COLLECTIVE_TIMEOUT_S, else 300 s; 0: only the
            process group's timeout). It also bounds the wait for the other ranks where the root's
            first forward creates process groups (reshard_after_forward=k's among them); left
            unset, that first wait is the process group's own timeout, as torch's first
            collective waits (a rank may be loading a checkpoint alone).
        check_finite_grads: raise NonFiniteGradientError naming the unit, parameter and rank as
            soon as a NaN/Inf gradient reaches this unit's reduce-scatter (one extra tiny
            all-reduce per bucket; default: FSDP_EXT_CHECK_FINITE_GRADS=1, else off).
        comm_policy: fsdp_ext extension: a CommPolicy putting fewer bytes on the wire (int8 or
            fp8 parameter all-gathers, int8 or bf16 gradient reductions; runtime/wire/comm_policy.py).
            None (default): the root's, if it has one; else exact.
    """
    members = _members(module)
    if dp_mesh_dims is not None:  # the SPMD mesh and its data-parallel axes
        if process_group is not None:
            raise ValueError(f"fully_shard({type(members[0]).__name__}): dp_mesh_dims names axes "
                             "of `mesh`; pass no process_group with it")
        mesh, process_group, storage_axes = data_parallel_mesh(
            mesh, dp_mesh_dims, f"fully_shard({type(members[0]).__name__})")
    else:
        storage_axes = None
    if mesh is None and process_group is None:
        default_group.ensure_for_fully_shard()
    return shard_module(module, mesh=mesh, process_group=process_group, options=UnitOptions(
        mp=options.mp_policy(mp_policy), layout="rows",
        reshard_after_forward=reshard_after_forward,
        offload=options.offload_policy(offload_policy),
        ignored_params=frozenset(id(p) for p in ignored_params or ()),
        param_init_fn=param_init_fn, check_finite_grads=check_finite_grads, comm_policy=comm_policy,
        shard_placement_fn=shard_placement_fn, storage_axes=storage_axes,
        schedule=ScheduleOptions(forward_prefetch=forward_prefetch,
                                 backward_prefetch=backward_prefetch,
                                 limit_in_flight=limit_in_flight,
                                 collective_timeout=collective_timeout)))


def _members(module) -> list[nn.Module]:
    """fully_shard's argument as a list of modules, checked."""
    if not isinstance(module, (list, tuple)):
        return [module]
    members = list(module)
    if not members or not all(isinstance(m, nn.Module) for m in members):
        raise ValueError(f"fully_shard: expects a module or a non-empty list of modules, got "
                         f"[{', '.join(type(m).__name__ for m in members)}]")
    for i, outer in enumerate(members):
        for j, inner in enumerate(members):
            if i != j and any(m is inner for m in outer.modules()):
                raise ValueError(
                    f"fully_shard([...]): module {j} ({type(inner).__name__}) is inside module "
                    f"{i} ({type(outer).__name__}) of the same list; list each module once")
    return members


def shard_module(module: nn.Module, *, mesh=None, process_group=None,
                 options: UnitOptions) -> nn.Module:
    """fully_shard's work, for every public API: `options` are the user's, already read
    (api/options.py), its `layout` "rows" (fully_shard: DTensor parameters) or "flat"
    (FullyShardedDataParallel: FSDP1's flat views); the unit's UnitConfig is resolved from them
    here, once, with its groups made from `mesh` or `process_group` and the environment read
    for this call (fsdp_ext/env.py).
    `options.direct_min_numel` (rows: which parameters are gathered directly,
    runtime/bucket/layout.py) is for benchmarks. `module` may be a list (fully_shard's)."""
    members = _members(module)
    for member in members:
        if unit_of(member) is not None:
            raise ValueError(f"{type(member).__name__} is already sharded by fully_shard")
        for name, sub in member.named_modules():
            if name and (sub_unit := unit_of(sub)) is not None and sub_unit.schedule is not None:
                raise ValueError(f"submodule '{name}' already ran forward; shard before the first "
                                 "forward")
    together = members[0] if len(members) == 1 else nn.ModuleList(members)  # (not kept)
    offload_policy = options.offload
    device = _device_for(together, mesh.device_type if mesh is not None else None,
                         offload_policy is not None)
    if (device.type != "cpu" and offload_policy is None
            and any(p.device != device and not p.is_meta for p in together.parameters())):
        together.to(device)
    if offload_policy is not None and device.type != "cpu":  # shards stay on the host, buffers move
        for sub in together.modules():
            for name, buf in sub._buffers.items():
                if buf is not None:
                    sub._buffers[name] = buf.to(device)
    check_mesh_and_groups(members[0], mesh, process_group)
    install_step_check()  # an optimizer built before this call is caught at its first step
    environment = env.read()  # the one read of the environment for this unit
    reshard_after_forward = options.reshard_after_forward
    groups = _groups_from(mesh, process_group, device, reshard_after_forward)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        # As in FSDP2: k == 1 keeps everything (False); k >= shard size is a full reshard (True).
        reshard_after_forward = reshard_after_forward > 1
    check_finite_grads = options.check_finite_grads
    if check_finite_grads is None:
        check_finite_grads = environment.check_finite_grads
    comm_policy = check_policy(options.comm_policy, options.mp,
                               f"fully_shard({type(members[0]).__name__})")
    given = {f.name: getattr(options, f.name) for f in dataclasses.fields(UnitOptions)}
    config = UnitConfig(**{**given, "reshard_after_forward": reshard_after_forward,
                           "check_finite_grads": check_finite_grads,
                           "comm_policy": comm_policy},
                        groups=groups, env=environment, mesh=mesh)
    unit = (ListUnit if len(members) > 1 else Unit)(members, config)
    name_replaced_from(unit)  # an optimizer built before this call names them in the model
    for member in members:
        member.__dict__[UNIT_ATTR] = unit
        install_state_dict_hooks(member)
        pipelining.register(member)  # what torch's pipelining stages ask of an FSDP module
        cls = member.__class__
        if not isinstance(member, FSDPModule):
            if cls not in _FSDP_CLASSES:
                _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
            member.__class__ = _FSDP_CLASSES[cls]
    return module
