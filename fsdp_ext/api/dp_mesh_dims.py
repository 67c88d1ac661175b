"""`fully_shard(mesh=<the whole SPMD mesh>, dp_mesh_dims=DataParallelMeshDims(...))`: torch 2.14's
way of naming the data-parallel axes of a mesh that also carries other parallelisms (torchtitan's
`spmd_types` and `full_dtensor` backends pass their dense storage mesh so).

The named axes become the unit's data-parallel mesh as torch's `_fsdp_init._get_mesh_info` makes
it: several shard axes flattened into one (`mesh[names]._flatten("_".join(names))`), a replicate
axis beside them making it HSDP (`DeviceMesh._concatenate([replicate, shard])`), replicate axes
alone making it replicate-only (every rank holds the whole unit; gradients all-reduced). From there
the unit is what `fully_shard(mesh=<that mesh>)` makes of it.

The parameters must hold their data-parallel values whole on every rank: plain tensors (torchtitan's
`spmd_types` backend annotates them with the `R` type on those axes) or DTensors on the SPMD mesh,
Replicate on those axes (its `full_dtensor` backend: runtime/placement/model_parallel.OnStorageMesh, whose
face carries the flattened shard mesh where torch's does; its shard axes must be adjacent). Another
axis of several ranks (tensor parallel) is read from what the parameter says of it: a DTensor's
placements, a plain tensor's spmd_types annotation (runtime/placement/spmd_params.py: S(dim), R or I; a
missing one, or a second such axis, refused naming the parameter). A DTensor on another mesh is
refused naming the parameter.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..runtime.placement.spmd_params import StorageAxes


def data_parallel_mesh(mesh: DeviceMesh | None, dp_mesh_dims,
                       where: str) -> tuple[DeviceMesh | None, tuple | None, tuple]:
    """(mesh, process_group) for the unit, as `fully_shard` takes them, from the SPMD mesh and
    its data-parallel axes, and (the SPMD mesh, the shard axes' names, the replicate axes'),
    which its parameters are read on; raises ValueError / NotImplementedError naming what
    is wrong."""
    shard_names, replicate_names = _names(dp_mesh_dims, where)
    if mesh is None:
        raise ValueError(f"{where}: dp_mesh_dims names axes of `mesh`; pass the SPMD mesh too")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"{where}: mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in (*shard_names, *replicate_names):
        if name not in names:
            raise ValueError(f"{where}: dp_mesh_dims names '{name}', which is not an axis of the "
                             f"mesh (mesh_dim_names {names})")
    both = set(shard_names) & set(replicate_names)
    if both:
        raise ValueError(f"{where}: dp_mesh_dims names {sorted(both)} as both shard and replicate")
    # What a parameter holds on another axis of several ranks its own type says: a DTensor's
    # placements (model_parallel.OnStorageMesh), a plain tensor's spmd_types annotations
    # (spmd_params.py, which refuses a missing one naming the parameter).
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{where}: dp_mesh_dims needs an initialised process group")
    storage_axes = StorageAxes(mesh, shard_names, replicate_names)
    if not shard_names:  # replicate only: no shard group
        return None, (None, _submesh(mesh, replicate_names).get_group()), storage_axes
    shard = _submesh(mesh, shard_names)
    if not replicate_names:
        return shard, None, storage_axes
    return (DeviceMesh._concatenate([_submesh(mesh, replicate_names), shard]), None,
            storage_axes)


def _names(dp_mesh_dims, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    shard = getattr(dp_mesh_dims, "shard_names", None)
    replicate = getattr(dp_mesh_dims, "replicate_names", None)
    if shard is None or replicate is None:
        raise TypeError(f"{where}: dp_mesh_dims must be a DataParallelMeshDims, got "
                        f"{type(dp_mesh_dims).__name__}")
    if not shard and not replicate:
        raise ValueError(f"{where}: at least one of shard or replicate must be set in "
                         "dp_mesh_dims")
    return tuple(shard), tuple(replicate)


def _submesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """One axis as it is; several flattened into one, as torch's fully_shard does (the flattened
    mesh is cached on the root mesh under its name, so every unit shares its process group)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))
