"""Parameters of torchtitan's `spmd_types` backend split by model parallelism (its routed experts
under expert parallelism, its tensor-parallel weights): plain tensors holding this rank's part of
the weight, annotated with spmd_types on the axes of a storage mesh, which fully_shard's
`dp_mesh_dims`, or a ShardPlacementResult's mesh-info, names (`efsdp` data-parallel, `ep` not;
`dp_shard` data-parallel, `tp` not).

The data-parallel axes are fsdp_ext's to shard over (the mesh-info's `mesh`); what the annotations
say of the one other axis with several ranks becomes the parameter's model-parallel spec, the
part a tensor-parallel DTensor carries itself: e.g. an expert weight `S(0)` over `ep` holds its
experts' rows, so its DTensor face is (Shard(dim) over efsdp, Shard(0) over ep), as torch's
fully_shard stores it. The module computes with the plain gathered tensor, as it was given.

Taken: `S(dim)` (a shard; its gradient stays sharded), `I` (invariant: the same values, and
gradient, on every rank of the axis) and `R` (the same values, each rank holding part of the
gradient: summed over the axis in backward, as torch's fully_shard sums it). Refused naming the
parameter: `P`, a plain `V`, and several such axes. torchtitan's TP under this backend annotates
its split weights `S(dim)` on `tp` and its norms `R`; its experts `S(0)` on `ep`. A DTensor on
the storage mesh (torchtitan's full_dtensor backend) is read from its own placements instead
(model_parallel.OnStorageMesh).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .model_parallel import Annotated, on_storage_mesh


@dataclass(frozen=True)
class StorageAxes:
    """A storage mesh and the names of its data-parallel axes: the one form that fully_shard's
    `dp_mesh_dims` and a ShardPlacementResult's mesh-info (its `spmd_mesh`, `dp_mesh_dims`) both
    become."""

    mesh: object
    shard_names: tuple[str, ...]
    replicate_names: tuple[str, ...]

    @classmethod
    def of_mesh_info(cls, info) -> "StorageAxes | None":
        """A mesh-info's storage mesh, or None where it names no axes (a plain FSDP mesh)."""
        dims = getattr(info, "dp_mesh_dims", None)
        if dims is None:
            return None
        return cls(info.spmd_mesh, dims.shard_names, dims.replicate_names)

    def parallel_of(self, param: torch.Tensor, where: str):
        """How model parallelism split `param` on this mesh (parallel_of below)."""
        return parallel_of(param, self.mesh, self.shard_names, self.replicate_names, where)


def parallel_of(param: torch.Tensor, mesh, shard_names, replicate_names, where: str):
    """How model parallelism split `param`, given on the storage mesh `mesh` whose data-parallel
    axes are named: a DTensor on that mesh (OnStorageMesh), an annotated plain tensor with a
    model-parallel axis of several ranks (Annotated), or None (a plain tensor whole there)."""
    if isinstance(param, DTensor):
        return on_storage_mesh(param, mesh, shard_names, replicate_names, where)
    names = mesh.mesh_dim_names
    data_parallel = {*shard_names, *replicate_names}
    others = [n for n in names if n not in data_parallel and mesh.size(names.index(n)) > 1]
    if not others:
        return None
    if len(others) > 1:
        raise NotImplementedError(f"{where}: its storage mesh has {len(others)} axes "
                                  f"besides the data-parallel ones with several ranks {others}; "
                                  "fsdp_ext takes one (expert or tensor parallel)")
    axis_name = others[0]
    placement, sums = _placement(_annotation(param, mesh, axis_name, where), axis_name, where)
    sum_over = (mesh.get_group(axis_name),) if sums else ()
    size = mesh.size(names.index(axis_name))
    shape = list(param.shape)
    if isinstance(placement, Shard):
        shape[placement.dim] *= size
    shape = torch.Size(shape)
    meta = TensorMeta(shape, torch._prims_common.make_contiguous_strides_for(shape), param.dtype)
    return Annotated(DTensorSpec(mesh[axis_name], (placement,), tensor_meta=meta), sum_over)


def _annotation(param: torch.Tensor, mesh, axis_name: str, where: str):
    try:
        import spmd_types as spmd
        from spmd_types.runtime import get_partition_spec
        from spmd_types.types import partition_spec_to_shard_types
    except ImportError as exc:
        raise NotImplementedError(f"{where}: a mesh-info over named SPMD axes with a "
                                  f"model-parallel axis '{axis_name}' needs spmd_types") from exc
    kinds = dict(spmd.get_local_type(param))
    spec = get_partition_spec(param)
    if spec is not None:
        kinds.update(partition_spec_to_shard_types(spec))
    kind = kinds.get(spmd.MeshAxis.of(mesh.get_group(axis_name)))
    if kind is None:
        raise ValueError(f"{where}: no spmd_types annotation on the storage mesh's axis "
                         f"'{axis_name}' (annotated: {kinds}); annotate it (S(dim), R or I), as "
                         "torch's fully_shard requires too")
    return kind


def _placement(kind, axis_name: str, where: str) -> tuple[object, bool]:
    """(the DTensor placement of `kind`, whether its gradient is summed over the axis: R, the
    same values on every rank there, each holding part of the gradient (its backward type is P),
    summed before the data-parallel reduction as torch's fully_shard redistributes it, Partial
    to Replicate)."""
    import spmd_types as spmd

    if kind is spmd.I or kind is spmd.R:
        return Replicate(), kind is spmd.R
    if isinstance(kind, spmd.S):
        return Shard(kind.dim), False
    raise NotImplementedError(
        f"{where}: annotated {getattr(kind, 'name', kind)} on the model-parallel axis "
        f"'{axis_name}'; fsdp_ext takes S(dim) (sharded there), R (replicated, its gradient "
        "summed there) or I (invariant) on it: a P parameter has no whole value, a plain V "
        "says nothing of which dim is split")
