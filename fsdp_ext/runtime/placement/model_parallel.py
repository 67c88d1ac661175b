"""A parameter that model parallelism (tensor or expert parallel) split before fully_shard: fsdp_ext
shards its local tensor again, over its data-parallel mesh. Each spelling in which such a
parameter arrives is one class; the runtime and the state paths ask it, never which it is:

    TensorParallel   a DTensor on its own TP / EP mesh (parallelize_module; torchtitan's
                     partial_dtensor backend): the module computes with that DTensor
    Annotated        a plain tensor annotated with spmd_types on a storage mesh's model-parallel
                     axis (torchtitan's spmd_types backend; spmd_params.py reads it): the module
                     computes with the plain tensor, as it was given
    OnStorageMesh    a DTensor on the whole storage mesh, Replicate on its data-parallel axes
                     (torchtitan's full_dtensor backend): the module computes with a DTensor on
                     that mesh, and its gradient keeps the data-parallel placements it comes
                     with (Partial: the reduce-scatter sums them) as torch's fully_shard keeps them

Each is a Placement (base.py) and answers its questions: `face_spec` (the sharded parameter's
DTensor spec, as torch's fully_shard builds it), `compute_view` (what the module computes with,
over the gathered local tensor), `full_tensor` (the global value from the gathered local tensor),
`norm_groups` (over which groups a rank's part of the gradient is summed for a norm, besides the
data-parallel ones); all refuse `require_whole` (a rank's gathered tensor is its part).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard

from .base import Placement


class ModelParallel(Placement):
    """What every model-parallel spelling shares: a DTensorSpec `spec` of the parameter as the
    module sees it, whose global shape is the state dict's."""

    spec: DTensorSpec

    def global_shape(self, local_shape: torch.Size) -> torch.Size:
        return self.spec.tensor_meta.shape

    def require_whole(self, refusal) -> None:
        raise refusal()


class TensorParallel(ModelParallel):
    """A DTensor on a 1-D TP / EP mesh; `spec` is its (the module's) DTensorSpec."""

    def __init__(self, spec: DTensorSpec):
        self.spec = spec

    def check(self, where: str, storage_axes) -> None:
        """Refuse what fully_shard cannot shard: a DTensor on another mesh than the storage
        mesh dp_mesh_dims names (`storage_axes`), or on a TP mesh of several dims."""
        if storage_axes is not None:
            raise NotImplementedError(
                f"{where} is a DTensor on {self.spec.mesh} ({self.spec.placements}); with "
                "dp_mesh_dims fsdp_ext shards plain parameters (torchtitan's spmd_types backend) "
                "and DTensors on the SPMD mesh it names (its full_dtensor backend), not DTensors "
                "on another mesh")
        if self.spec.mesh.ndim != 1:
            raise NotImplementedError(
                f"{where} is already a DTensor on a {self.spec.mesh.ndim}-D mesh: fully_shard "
                "shards tensor-parallel parameters of a 1-D TP mesh, or DTensors on the storage "
                "mesh dp_mesh_dims names")

    def check_own_mesh(self, mesh, where: str) -> None:
        """Its data-parallel mesh is 1-D: face_spec concatenates it with TP's."""
        if mesh.ndim == 2:
            raise NotImplementedError(f"{where} puts a tensor- or expert-parallel parameter on a "
                                      "2-D (replicate, shard) mesh of its own: fsdp_ext shards "
                                      "such parameters over a 1-D data-parallel mesh")

    def face_spec(self, dp_mesh: DeviceMesh, shape=None, dtype=None) -> DTensorSpec:
        """Sharded along `dim` of the local tensor on `dp_mesh`: the (dp, tp) mesh, the dp
        placement first. Where TP itself shards `dim`, chunking its local part is a strided
        shard of the global one (EP's experts: Shard(0) over ep, then again over efsdp)."""
        if dp_mesh.ndim != 1 or self.spec.mesh.ndim != 1:
            raise NotImplementedError("fully_shard with tensor parallelism: 1-D data-parallel and "
                                      f"TP meshes only (got {dp_mesh.ndim}-D and "
                                      f"{self.spec.mesh.ndim}-D)")
        dim = self.dim
        split = self.spec.num_shards_map[dim]
        dp = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        return DTensorSpec(DeviceMesh._concatenate([dp_mesh, self.spec.mesh]),
                           (dp, *self.spec.placements), tensor_meta=self.spec.tensor_meta)

    def compute_view(self, local: torch.Tensor) -> torch.Tensor:
        """The DTensor the module computes with; differentiable, so that its gradient comes back
        as the local tensor's (reduced over the TP mesh where the placement was Replicate)."""
        return self._dtensor(local)

    def full_tensor(self, local: torch.Tensor) -> torch.Tensor:
        return self._dtensor(local).full_tensor()

    def _dtensor(self, local: torch.Tensor) -> DTensor:
        meta = self.spec.tensor_meta
        return DTensor.from_local(local, self.spec.mesh, self.spec.placements, run_check=False,
                                  shape=meta.shape, stride=meta.stride)

    def norm_groups(self) -> tuple:
        """The TP group where TP shards the parameter (a TP-replicated gradient is the same on
        every TP rank: counted once)."""
        if any(p.is_shard() for p in self.spec.placements):
            return (self.spec.mesh.get_group(),)
        return ()


class Annotated(TensorParallel):
    """A plain tensor whose spmd_types annotation on one model-parallel axis gave `spec`; its
    gradient summed over `sum_over` (R there: each rank holds part of it)."""

    def __init__(self, spec: DTensorSpec, sum_over: tuple = ()):
        super().__init__(spec)
        self.sum_over = sum_over

    def check(self, where: str, storage_axes) -> None:
        """(spmd_params.py read it from the storage mesh its mesh-info names.)"""

    def compute_view(self, local: torch.Tensor) -> torch.Tensor:
        return _SumGradient.apply(local, self.sum_over) if self.sum_over else local


class _SumGradient(torch.autograd.Function):
    """The tensor itself; backward sums its gradient over `groups` (each rank's part)."""

    @staticmethod
    def forward(ctx, local, groups):
        ctx.groups = groups
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        for group in ctx.groups:
            dist.all_reduce(grad, group=group)
        return grad, None


class OnStorageMesh(ModelParallel):
    """A DTensor on the whole storage mesh, whose axes at `data_parallel` (indices) fsdp_ext
    shards over: the `shard_axes` (none: replicate only; several: flattened into one, as torch's
    fully_shard flattens them) sharded, the replicate axes left Replicate."""

    def __init__(self, spec: DTensorSpec, shard_axes: tuple[int, ...],
                 data_parallel: frozenset[int]):
        self.spec, self.shard_axes, self.data_parallel = spec, shard_axes, data_parallel

    def check(self, where: str, storage_axes) -> None:
        """(on_storage_mesh checked it against the storage mesh.)"""

    def face_spec(self, dp_mesh: DeviceMesh, shape=None, dtype=None) -> DTensorSpec:
        """Shard(dim) on the shard axis, strided where an axis after it shards `dim` too, as
        torch's fully_shard places it. One shard axis: on the storage mesh itself. Several: on
        the storage mesh with those axes replaced by the unit's data-parallel mesh `dp_mesh`
        (flattened; HSDP's replicate axis before it). None: the parameter's own spec."""
        mesh, placements = self.spec.mesh, list(self.spec.placements)
        if not self.shard_axes:
            return self.spec
        first, dim = self.shard_axes[0], self.dim
        split = 1
        for axis in range(first + 1, mesh.ndim):
            p = placements[axis]
            if isinstance(p, (Shard, _StridedShard)) and p.dim == dim:
                split *= mesh.size(axis)
        shard = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        if len(self.shard_axes) == 1:
            placements[first] = shard
            return DTensorSpec(mesh, tuple(placements), tensor_meta=self.spec.tensor_meta)
        names, meshes, faces = mesh.mesh_dim_names, [], []
        for axis, p in enumerate(placements):
            if axis == first:
                meshes.append(dp_mesh)
                faces.extend((Replicate(), shard) if dp_mesh.ndim == 2 else (shard,))
            elif axis not in self.data_parallel:
                meshes.append(mesh[names[axis]])
                faces.append(p)
        return DTensorSpec(DeviceMesh._concatenate(meshes), tuple(faces),
                           tensor_meta=self.spec.tensor_meta)

    def compute_view(self, local: torch.Tensor) -> torch.Tensor:
        return _OnStorageMesh.apply(local, self.spec, self.data_parallel)

    def full_tensor(self, local: torch.Tensor) -> torch.Tensor:
        return DTensor(local, self.spec, requires_grad=False).full_tensor()

    def norm_groups(self) -> tuple:
        mesh = self.spec.mesh
        return tuple(mesh.get_group(axis) for axis, p in enumerate(self.spec.placements)
                     if axis not in self.data_parallel and p.is_shard() and mesh.size(axis) > 1)


class _OnStorageMesh(torch.autograd.Function):
    """The gathered local tensor as a DTensor of `spec`. Backward keeps the gradient's placements
    on the data-parallel axes (a Partial there is the reduce-scatter's to sum; resolving it
    here would all-reduce it first) and brings the others to the parameter's."""

    @staticmethod
    def forward(ctx, local, spec, data_parallel):
        ctx.spec, ctx.data_parallel = spec, data_parallel
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            return grad, None, None
        target = tuple(grad.placements[i] if i in ctx.data_parallel else p
                       for i, p in enumerate(ctx.spec.placements))
        if target != tuple(grad.placements):
            grad = grad.redistribute(ctx.spec.mesh, target)
        local = grad._local_tensor
        wait = getattr(local, "wait", None)  # an AsyncCollectiveTensor from the redistribution
        return (wait() if callable(wait) else local), None, None


def data_parallel_axes(mesh: DeviceMesh, shard_names, replicate_names, where: str):
    """(the shard axes' indices, the data-parallel axes' indices) of a storage mesh's named
    axes. Several shard axes must be adjacent, in the mesh's order: torch's fully_shard puts
    their flattened mesh where they stand."""
    names = mesh.mesh_dim_names
    shard_axes = tuple(names.index(n) for n in shard_names)
    if shard_axes and shard_axes != tuple(range(shard_axes[0], shard_axes[0] + len(shard_axes))):
        raise NotImplementedError(
            f"{where}: a DTensor parameter on the storage mesh {names} with shard axes "
            f"{list(shard_names)}; fsdp_ext flattens shard axes that stand next to each other, "
            "in the mesh's order")
    axes = frozenset(names.index(n) for n in (*shard_names, *replicate_names))
    return shard_axes, axes


def on_storage_mesh(param: DTensor, mesh: DeviceMesh, shard_names, replicate_names,
                    where: str) -> OnStorageMesh:
    """`param` (a DTensor on the storage mesh `mesh`) read as torch's fully_shard reads it:
    Replicate on every data-parallel axis."""
    if param.device_mesh != mesh:
        raise ValueError(f"{where}: a DTensor on {param.device_mesh}, not on the storage mesh "
                         f"{mesh} its mesh-info names")
    shard_axes, axes = data_parallel_axes(mesh, shard_names, replicate_names, where)
    for axis in sorted(axes):
        if not isinstance(param.placements[axis], Replicate):
            raise ValueError(f"{where}: {param.placements[axis]} on the data-parallel axis "
                             f"'{mesh.mesh_dim_names[axis]}'; fully_shard takes Replicate() "
                             "there (it shards over that axis itself)")
    return OnStorageMesh(param._spec, shard_axes, axes)
