"""DTensor parameters and gradients over the shard (the rows layout, fully_shard's).

Outside forward and backward each parameter is an nn.Parameter holding a DTensor: placement
Shard(0) on the shard mesh dimension (Replicate() first under HSDP), the parameter's global shape,
and as local tensor this rank's rows: a view of the bucket's flat shard, so the optimizer's in-place
updates land in the all-gather input and nothing is copied. `.grad` is a DTensor of the same spec
over the gradient shard. That is what torch's FSDP2 exposes, so clip_grad_norm_, the
torch.distributed.checkpoint state-dict helpers, DCP and `full_tensor()` work unchanged.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..comm.process_groups import subgroup


def storage_mesh(mesh: DeviceMesh | None, shard_group, replicate_group,
                 device: torch.device) -> DeviceMesh | None:
    """The mesh the DTensor parameters live on: the user's (1-D shard, or 2-D replicate x shard),
    else one made from the process groups; None without a process group (nothing to shard over:
    parameters stay plain tensors)."""
    if mesh is not None:
        return mesh
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if shard_group is None:  # this rank alone holds the unit (a world of one, or a shard of one)
        shard_group = dist.group.WORLD if dist.get_world_size() == 1 else subgroup([dist.get_rank()])
    shard = shard_group
    if replicate_group is None:
        return DeviceMesh.from_group(shard, device.type)
    return DeviceMesh.from_group([replicate_group, shard], device.type,
                                 mesh=_grid(replicate_group, shard),
                                 mesh_dim_names=("replicate", "shard"))


def _grid(replicate_group, shard_group) -> torch.Tensor:
    """The (replicate, shard) grid of global ranks both groups belong to."""
    shard_ranks = dist.get_process_group_ranks(shard_group)
    replicas = [None] * dist.get_world_size(replicate_group)
    dist.all_gather_object(replicas, shard_ranks, group=replicate_group)
    return torch.tensor(replicas, dtype=torch.int)


def spec(mesh: DeviceMesh, shape: torch.Size, dtype: torch.dtype, dim: int = 0) -> DTensorSpec:
    """Shard(dim) on the mesh's last dimension, Replicate() on the one before (HSDP)."""
    placements = (Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim))
    meta = TensorMeta(shape, torch._prims_common.make_contiguous_strides_for(shape), dtype)
    return DTensorSpec(mesh, placements, tensor_meta=meta)


def dispatches_itself(tensor: torch.Tensor) -> bool:
    """A tensor subclass with a `__torch_dispatch__` of its own (torchao's weights, NF4): a
    storage-less wrapper, unlike a plain tensor or an nn.Parameter subclass."""
    return type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _wrap(local: torch.Tensor, sharding: DTensorSpec) -> DTensor:
    """A DTensor of `sharding` whose local tensor is `local`, a view at any offset of a shard.

    DTensor's constructor gives the wrapper the local tensor's storage offset, and the wrapper
    has no storage: at a nonzero offset its data_ptr() is nonzero, which is how torch's
    checkpoint stager (dcp.async_save) tells a plain tensor from a wrapper, so it then copies the
    wrapper's (invalid) storage and fails. Built over a zero-offset view of the same storage (no
    copy), then given `local`, the wrapper looks as FSDP2's own do. A tensor subclass (its
    own storage-less wrapper, wire/subclass.py) is wrapped as it is."""
    if dispatches_itself(local):
        return DTensor(local, sharding, requires_grad=False)
    at_zero = local.as_strided(local.shape, local.stride(), 0)
    dtensor = DTensor(at_zero, sharding, requires_grad=False)
    dtensor._local_tensor = local
    return dtensor


def detached(param: DTensor) -> DTensor:
    """`param.detach()`, its wrapper at offset 0 as `_wrap` makes them."""
    return _wrap(param._local_tensor.detach(), param._spec)


def make_param(local: torch.Tensor, sharding: DTensorSpec, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(_wrap(local, sharding), requires_grad=requires_grad)


def as_dtensor(local: torch.Tensor, sharding: DTensorSpec) -> DTensor:
    """A DTensor of `sharding` over `local` (a gradient, or an optimizer state, of a parameter)."""
    return _wrap(local, sharding)


def set_local(param: torch.Tensor, local: torch.Tensor) -> None:
    """Make `local` the DTensor parameter's local tensor (FSDP2 does the same after `_apply`)."""
    param._local_tensor = local


def data_was_replaced(param: torch.Tensor) -> bool:
    """Whether `param.data = tensor` was done to a DTensor parameter. Its wrapper holds no data
    (reading the storage's address raises); the assignment gives it some, which DTensor's ops
    ignore: they read only the local tensor. A silently dropped change, so the runtime refuses it."""
    try:
        return param.untyped_storage().data_ptr() != 0
    except RuntimeError:  # "invalid python storage": the wrapper's own (empty) storage
        return False


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def is_dtensor(tensor) -> bool:
    return isinstance(tensor, DTensor)
