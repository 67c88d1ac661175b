"""The placement a parameter's own spelling gives it, before shard_placement_fn (shard_fn.py)
places it: the one place that looks at what a parameter is."""
from __future__ import annotations

from . import dtensor_params
from .base import Placement
from .model_parallel import TensorParallel
from .replicated import Replicated
from .spmd_params import StorageAxes


def initial(param, storage_axes: StorageAxes | None, where: str) -> Placement:
    """As the storage mesh `storage_axes` names says (fully_shard's dp_mesh_dims: a DTensor on
    it, or a plain tensor's annotations there;
    a plain tensor whole there is Replicated on it where no axis shards, as torch's face for
    replicate-only axes is), else a DTensor on a tensor-parallel mesh of its own, or a plain
    tensor (Placement)."""
    if storage_axes is not None and (not dtensor_params.is_dtensor(param)
                                     or param.device_mesh == storage_axes.mesh):
        split = storage_axes.parallel_of(param, where)
        if split is not None:
            return split
        return Placement() if storage_axes.shard_names else Replicated(storage_axes.mesh)
    return TensorParallel(param._spec) if dtensor_params.is_dtensor(param) else Placement()
