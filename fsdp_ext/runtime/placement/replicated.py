"""A parameter every rank of a 1-D mesh holds whole: torch's `replicate` (FSDP2-based DDP). The unit
has no shard group, so there is nothing to gather (its unshard is a local copy into the compute
buffer, as with one shard rank) and its gradient is all-reduced over the mesh, averaged, as DDP's
is; the parameter's face is a DTensor `Replicate()` on that mesh, as torch's replicate makes it.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .base import Placement


class Replicated(Placement):
    """Whole on every rank of `replicate_mesh`: 1-D (replicate's), or the storage mesh that
    fully_shard's replicate-only dp_mesh_dims names (Replicate() on each of its axes)."""

    def __init__(self, replicate_mesh):
        self.replicate_mesh = replicate_mesh

    def face_spec(self, dp_mesh, shape: torch.Size, dtype: torch.dtype) -> DTensorSpec:
        meta = TensorMeta(shape, torch._prims_common.make_contiguous_strides_for(shape), dtype)
        return DTensorSpec(self.replicate_mesh, (Replicate(),) * self.replicate_mesh.ndim,
                           tensor_meta=meta)

    def describe(self, groups) -> list[str]:
        return [f"replicated over the {self.replicate_mesh.size()} ranks of "
                f"{self.replicate_mesh.mesh_dim_names or 'its mesh'}: nothing sharded, "
                "gradients all-reduced"]
