"""`replicate` (torch 2.14's `torch.distributed._composable.replicate_with_fsdp.replicate`:
FSDP2-based DDP): every rank holds the whole module, gradients are all-reduced (averaged) over the
mesh. Its parameters are DTensors `Replicate()` on that 1-D mesh, as torch's are; the module joins
`ReplicateModule`, an FSDPModule with torch's methods (set_requires_gradient_sync, unshard, ...).

It is fully_shard's work with another placement (runtime/placement/replicated.py) over a unit
with no shard group: nothing here branches on it elsewhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule as _TorchReplicate
from torch.distributed.device_mesh import init_device_mesh

from ..runtime.placement.replicated import Replicated
from ..runtime.core.registry import unit_of
from ..runtime.unit.schedule_options import ScheduleOptions
from ..runtime.unit.config import UnitOptions
from . import default_group, options, pipelining
from .dp_mesh_dims import data_parallel_mesh
from .fsdp_module import FSDPModule
from .fully_shard import _members, fully_shard, shard_module
from .options import MixedPrecisionPolicy, OffloadPolicy


class ReplicateModule(FSDPModule, _TorchReplicate):
    """Joined by every module passed to `replicate` (its class becomes a subclass)."""

    # [Replicate<Orig>, this, fsdp_ext's FSDPModule, torch's ReplicateModule, torch's FSDPModule,
    # Orig, ...]: where torch's __new__ finds the original class
    _orig_cls_mro_index = 5


_REPLICATE_CLASSES: dict[type, type] = {}


def replicate(module: nn.Module | list[nn.Module], *, mesh=None,
              mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
              offload_policy: OffloadPolicy = OffloadPolicy(), ignored_params=None,
              dp_mesh_dims=None):
    """Replicate `module` (or a list of modules, as one unit) over `mesh`, a 1-D DeviceMesh
    (default: every rank), as torch's replicate does; `dp_mesh_dims` names replicate axes of an
    SPMD mesh instead (no shard axis: fully_shard shards). Apply it bottom-up, as fully_shard."""
    members = _members(module)
    where = f"replicate({type(members[0]).__name__})"
    for member in members:
        if unit_of(member) is not None:
            raise RuntimeError(f"{where}: the module is already managed by fully_shard or "
                               "replicate")
    if dp_mesh_dims is not None:
        if getattr(dp_mesh_dims, "shard_names", ()):
            raise ValueError(f"{where}: replicate() with dp_mesh_dims requires replicate-only "
                             "dims (no shard dims); use fully_shard() for sharding")
        fully_shard(module, mesh=mesh, dp_mesh_dims=dp_mesh_dims, mp_policy=mp_policy,
                    offload_policy=offload_policy, ignored_params=ignored_params,
                    reshard_after_forward=False)
    else:
        mesh = mesh if mesh is not None else _default_mesh()
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"{where}: replicate expects a 1D DeviceMesh but got {mesh}")
        placement = Replicated(mesh) if mesh is not None else None
        shard_module(module, process_group=(None, mesh.get_group()) if mesh is not None else None,
                     options=UnitOptions(
                         mp=options.mp_policy(mp_policy), layout="rows",
                         reshard_after_forward=False,
                         offload=options.offload_policy(offload_policy),
                         ignored_params=frozenset(id(p) for p in ignored_params or ()),
                         shard_placement_fn=placement and (lambda param: placement),
                         schedule=ScheduleOptions()))
    for member in members:
        orig = type(member).__mro__[FSDPModule._orig_cls_mro_index]
        if orig not in _REPLICATE_CLASSES:
            _REPLICATE_CLASSES[orig] = type(f"Replicate{orig.__name__}", (ReplicateModule, orig),
                                            {})
        member.__class__ = _REPLICATE_CLASSES[orig]
        pipelining.register_replicate(member)
    return module


def _default_mesh():
    """torch's default: every rank, on the accelerator's device type if there is one; None in
    fully_shard's single-process mode (no process group and no launcher: default_group.py)."""
    default_group.ensure_for_fully_shard()
    if not (dist.is_available() and dist.is_initialized()):
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("replicate",))
