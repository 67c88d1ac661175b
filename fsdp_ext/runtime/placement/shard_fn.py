"""Where a parameter is sharded, and over which mesh: fully_shard's `shard_placement_fn(param)`
read as torch's fully_shard reads it.

    None (and no function)           Shard(0) over the unit's mesh
    Shard(dim)                       any dim of the parameter (negative: from the end), over the
                                     unit's mesh; torch.chunk's chunks along it, uneven sizes
                                     padded in the shard (layout.py)
    ShardPlacementResult(p, info)    torch 2.14's per-parameter mesh: `p` (Shard(dim) or None)
                                     over `info.mesh`, an FSDPMeshInfo (1-D mesh) or HSDPMeshInfo
                                     (2-D: replicate, shard), as torch's _get_mesh_info makes them
                                     (with `dp_mesh_dims`, as torchtitan's SPMD backends make
                                     them: the data-parallel submesh of a storage mesh whose
                                     other axis, e.g. `ep`, the parameter's annotation or
                                     placements describe: spmd_params.py, model_parallel.py)
    MeshPlacement(p, mesh)           the same without torch's internals: a 1-D or 2-D DeviceMesh
    a Placement object               used as it is (base.py; `replicate` gives each parameter
                                     replicated.Replicated)

A unit's parameters on other meshes form buckets of their own (param_buckets.py), gathered and
reduced over their mesh's groups. Refused at the call, naming the parameter: a dim out of range;
another placement type; a mesh that does not hold this rank; a mesh-info of another kind (DDP
only); Shard(dim > 0) or another mesh for a tensor-subclass parameter; a 2-D mesh of its own
for a parameter split over a TP / EP mesh of its own (not for one on the storage mesh).

A tensor- or expert-parallel parameter (a DTensor on its TP / EP mesh, as torchtitan's
expert parallelism makes the routed experts) is sharded along `dim` of its local tensor over its
data-parallel mesh (with EP: the expert-FSDP mesh `efsdp`), as torch's fully_shard shards it:
model_parallel.py. One given as a DTensor on the whole storage mesh its mesh-info names
(torchtitan's full_dtensor backend) keeps that mesh.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.tensor import Shard

from .base import Placement
from .spmd_params import StorageAxes

try:  # torch >= 2.14: shard_placement_fn may name a mesh per parameter
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult)
except ImportError:  # an older torch has no such result for a function to return
    FSDPMeshInfo = HSDPMeshInfo = ShardPlacementResult = ()


@dataclass(frozen=True)
class MeshPlacement:
    """fsdp_ext's spelling of a per-parameter mesh: shard `placement` (Shard(dim), or None for
    Shard(0)) over `mesh` (1-D: shard; 2-D: replicate, shard)."""

    placement: Shard | None
    mesh: object


def resolve(shard_placement_fn, slot, module, subclass: bool, unit_mesh) -> Placement:
    """The placement of `slot`'s parameter (of `module`), whose own spelling gave
    `slot.placement`: sharded along the dim, over the mesh (None: the unit's), that
    `shard_placement_fn` gives it; a mesh-info's named SPMD axes may say how model parallelism
    split it (spmd_params.py)."""
    if shard_placement_fn is None:
        return slot.placement
    where = f"fully_shard({type(module).__name__}): shard_placement_fn for parameter '{slot.fqn}'"
    result = shard_placement_fn(slot.param)
    if isinstance(result, Placement):  # a placement object (replicate's): used as it is
        slot.placement.require_whole(lambda: NotImplementedError(
            f"{where} returned {type(result).__name__}, which places plain parameters; this one "
            "is split by tensor or expert parallelism"))
        return result
    placement, mesh, parallel = result, None, None
    if isinstance(result, ShardPlacementResult):  # torch's (placement, mesh_info)
        placement, mesh = result.placement, _mesh_of(result.mesh_info, where)
        storage = StorageAxes.of_mesh_info(result.mesh_info)
        if storage is not None:  # named axes of a storage mesh: what the parameter holds there
            parallel = storage.parallel_of(slot.param, where)
    elif isinstance(result, MeshPlacement):
        placement, mesh = result.placement, result.mesh
        if mesh is None or mesh.ndim not in (1, 2):
            raise ValueError(f"{where} returned MeshPlacement with {mesh!r}: a 1-D (shard) or "
                             "2-D (replicate, shard) DeviceMesh")
    dim = _dim(placement, slot, where)
    if mesh is not None and unit_mesh is not None and mesh == unit_mesh:
        mesh = None
    if mesh is not None and mesh.get_coordinate() is None:
        raise ValueError(f"{where} returned a mesh over ranks {mesh.mesh.flatten().tolist()}, "
                         f"which does not hold rank {dist.get_rank()}: every rank that runs "
                         "fully_shard on this module must be in each parameter's mesh")
    if (dim or mesh is not None) and subclass:
        raise NotImplementedError(f"{where} asks for Shard({dim}) on a mesh of its own or a "
                                  "dim > 0: a tensor-subclass parameter is sharded along dim 0 "
                                  "over the unit's mesh only")
    chosen = parallel or slot.placement
    if mesh is not None:
        chosen.check_own_mesh(mesh, where)
    return chosen.placed(dim, mesh)


def _dim(placement, slot, where: str) -> int:
    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise NotImplementedError(f"{where} returned {placement!r}; fsdp_ext shards with "
                                  "Shard(dim) placements (or None for Shard(0))")
    ndim = len(slot.shape)
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < ndim:
        raise ValueError(f"{where} returned Shard({placement.dim}), out of range for its "
                         f"{ndim}-D shape {list(slot.shape)}")
    return dim


def _mesh_of(mesh_info, where: str):
    """The DeviceMesh of torch's FSDPMeshInfo (1-D) or HSDPMeshInfo (2-D: replicate, shard)."""
    if not isinstance(mesh_info, FSDPMeshInfo):
        raise TypeError(f"{where} returned a ShardPlacementResult whose mesh_info is a "
                        f"{type(mesh_info).__name__}; expected torch's FSDPMeshInfo or "
                        "HSDPMeshInfo (_fsdp_init._get_mesh_info makes them)")
    mesh, hybrid = mesh_info.mesh, isinstance(mesh_info, HSDPMeshInfo)
    expected = (2, 1, 0) if hybrid else (1, 0, None)
    if (mesh.ndim, mesh_info.shard_mesh_dim, mesh_info.replicate_mesh_dim) != expected:
        raise NotImplementedError(
            f"{where}: its {type(mesh_info).__name__} has a {mesh.ndim}-D mesh with "
            f"shard_mesh_dim={mesh_info.shard_mesh_dim}, "
            f"replicate_mesh_dim={mesh_info.replicate_mesh_dim}; fsdp_ext takes a 1-D shard "
            "mesh (FSDPMeshInfo) or a 2-D (replicate, shard) one (HSDPMeshInfo)")
    return mesh
