"""One parameter's placement: the single object the runtime, the state paths and the diagnostics
ask about a parameter's sharding, never which kind it is.

`Placement` itself is a plain tensor, whole on every rank before sharding: sharded along `dim`
over the unit's data-parallel mesh, or over `mesh`, a mesh of its own (fully_shard's
shard_placement_fn: shard_fn.py). Parameters that model parallelism split first are its
subclasses (model_parallel.py); each answers the same questions for its own spelling.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from . import dtensor_params
from ..comm.groups import Groups, record_made_later


class Placement:
    """Sharded along `dim` of the tensor this rank holds, over `mesh` (None: the unit's)."""

    dim: int = 0
    mesh: object = None

    def placed(self, dim: int, mesh) -> Placement:
        """This placement sharded along `dim` over `mesh` (None: the unit's), as a new object."""
        other = copy.copy(self)
        other._set_shard(dim, mesh)
        return other

    def _set_shard(self, dim: int, mesh) -> None:
        self.dim, self.mesh = dim, mesh

    def storage(self, unit_groups: Groups, unit_mesh, where: str) -> tuple[Groups, object]:
        """(the groups its bucket talks to, the mesh its DTensor face lives on): the unit's, or
        its own mesh's (`where` names the first parameter on it, for errors)."""
        if self.mesh is None:
            return unit_groups, unit_mesh
        return _own_groups(self.mesh, unit_groups, where), self.mesh

    def check(self, where: str, storage_axes) -> None:
        """Refuse, naming `where`, what fully_shard cannot shard (`storage_axes`: dp_mesh_dims'
        storage mesh and its named axes, or None)."""

    def check_own_mesh(self, mesh, where: str) -> None:
        """Refuse a mesh of its own that this placement cannot be sharded over."""

    def face_spec(self, dp_mesh, shape: torch.Size, dtype: torch.dtype) -> DTensorSpec:
        """The sharded parameter's DTensor spec on `dp_mesh`, as torch's fully_shard builds it."""
        return dtensor_params.spec(dp_mesh, shape, dtype, self.dim)

    def compute_view(self, local: torch.Tensor) -> torch.Tensor:
        """What the module computes with over the gathered tensor."""
        return local

    def full_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """The parameter's global value from the gathered tensor."""
        return local

    def global_shape(self, local_shape: torch.Size) -> torch.Size:
        """The parameter's global shape (its state-dict value's) from the shape sharded here."""
        return local_shape

    def norm_groups(self) -> tuple:
        """Over which groups, besides the data-parallel ones, a rank's part of the gradient is
        summed for a norm."""
        return ()

    def require_whole(self, refusal) -> None:
        """Raise `refusal()` unless gathering over data parallelism gives the whole parameter
        (a plain tensor to summon, or to load from a file: model parallelism keeps a part)."""

    def describe(self, groups) -> list[str]:
        """Lines for describe() about where a bucket of this placement lives (nothing on the
        unit's mesh)."""
        if self.mesh is None:
            return []
        return [f"on a mesh of their own: sharded over {_ranks(groups.shard)}"
                + (f", replicated over {_ranks(groups.replicate)}"
                   if groups.replicate is not None else "")]


def _own_groups(mesh, unit_groups: Groups, where: str) -> Groups:
    """The groups of a parameter's own mesh, with the unit's `reshard_after_forward=k` applied to
    its shard group as torch applies it per mesh: k must divide that mesh's shard size, and k
    equal to it keeps this rank's own shard as its post-forward chunk (regathered over the
    shard group)."""
    own = Groups.of_mesh(mesh, unit_groups.device)
    k = unit_groups.requested_post_forward  # (the unit's own k may have become True: its size)
    if k == 1:
        return own
    if own.shard_size % k:
        raise ValueError(f"{where} is sharded over a mesh of its own with {own.shard_size} "
                         f"shard ranks, which reshard_after_forward={k} does not divide")
    # k equal to the mesh's size regathers over its shard group itself; below it, its group is
    # made at the root's first forward (process_groups.make_first_forward_groups), under the
    # root's collective_timeout.
    if k == own.shard_size:
        record_made_later("post_forward", own.shard, k, own.shard)
    return dataclasses.replace(own, post_forward_size=k)


def _ranks(group) -> str:
    """A process group's global ranks (None: this rank alone)."""
    return f"ranks {dist.get_process_group_ranks(group)}" if group is not None else "this rank"
