"""Why whole-matrix ("Owned") storage has no DTensor face yet (docs/api.md, "Muon on sharded
parameters"): torch 2.14's DTensor has no ragged placement, and one of our own does not survive its
ops. A placement that keeps whole matrices on their owners (rank 0 holding all 6 rows of a [6, 4]
matrix, rank 1 none) is written here as a `Shard` subclass that carries the per-rank row counts
and gathers accordingly. These checks pass while torch rebuilds placements as plain `Shard` /
`torch.chunk` ones, and fail the day it keeps such a placement: then that storage becomes
buildable. (Gathering the mislabelled result is not tried: torch.chunk's sizes disagree between
the ranks, and the all-gather waits for ever.)

The other face DTensor offers, a DTensor on a one-rank mesh holding the owner only (ranks outside
a mesh hold an empty local tensor, and torch's ops skip them), survives elementwise ops and the
optimizers' foreach kernels, but not what every trainer calls: the total gradient norm of
`clip_grad_norm_` stacks per-parameter norms from different meshes and is refused, and
`full_tensor()` gives the ranks outside the mesh an empty tensor (a full state dict written by
rank 0 would lack every matrix rank 0 does not own). Checked below; fails the day torch takes
norms across meshes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..helpers.dist import run_distributed


class _Rows(Shard):
    """Rows per rank along `dim` (`sizes`), whole matrices on their owners."""

    def __init__(self, dim: int, sizes: tuple[int, ...]):
        super().__init__(dim)
        self.sizes = tuple(sizes)

    def _local_shard_size_and_offset(self, curr_local_size, num_chunks, rank):
        return self.sizes[rank], sum(self.sizes[:rank])

    def _to_replicate_tensor(self, local, mesh, mesh_dim, current_logical_shape):
        most = max(self.sizes)
        padded = torch.cat([local, local.new_zeros(most - local.shape[0], *local.shape[1:])])
        gathered = funcol.all_gather_single(padded, gather_dim=0, group=(mesh, mesh_dim))
        return torch.cat([p[:n] for p, n in zip(gathered.split(most), self.sizes)])

    def __eq__(self, other):
        return isinstance(other, _Rows) and (other.dim, other.sizes) == (self.dim, self.sizes)

    def __ne__(self, other):
        # DTensorSpec checks a sharded dim's placement against Shard(dim) with `!=`
        return other.dim != self.dim if type(other) is Shard else not self == other

    def __hash__(self):
        return hash((self.dim, self.sizes))


def _worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).view(6, 4)
    placement = _Rows(0, (6, 0))
    local = full if rank == 0 else full[:0]
    ragged = DTensor.from_local(local.clone(), mesh, [placement], run_check=False,
                                shape=full.shape, stride=full.stride())
    assert ragged.placements == (placement,)
    # an elementwise op (an optimizer's update, zeros_like for its state): the placement comes
    # back as torch's own Shard(0), its row counts lost
    for result in (ragged * 2, torch.zeros_like(ragged)):
        assert type(result.placements[0]) is Shard, result.placements
        assert result.to_local().shape == local.shape  # while the data stays ragged
    # what DCP, full_tensor() and redistribute then take for this rank's part is torch.chunk's
    # (3 rows each), not the rows it holds: a checkpoint would record the wrong rows
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh,
                                                          (ragged * 2).placements)
    assert (shape[0], offset[0]) == (3, 3 * rank) != (local.shape[0], 0 if rank == 0 else 6)
    _one_rank_mesh_face(rank, mesh, full)
    dist.barrier()


def _one_rank_mesh_face(rank, mesh, full):
    """The owner's own mesh as the face: rank 0 holds the matrix, rank 1 an empty tensor."""
    owner_mesh = DeviceMesh("cpu", [0])  # (every rank makes it: a process group is created)
    owned = DTensor.from_local(full.clone() if rank == 0 else full.new_empty(0), owner_mesh,
                               [Replicate()], run_check=False, shape=full.shape,
                               stride=full.stride())
    doubled = owned * 2  # elementwise: the owner computes, the other rank skips
    assert doubled.placements == (Replicate(),)
    assert doubled.to_local().shape == (full.shape if rank == 0 else (0,))
    split = DTensor.from_local(full.chunk(2)[rank].clone(), mesh, [Shard(0)], run_check=False)
    with pytest.raises(RuntimeError, match="same mesh"):
        torch.nn.utils.get_total_norm([split, owned])  # clip_grad_norm_'s first half
    assert owned.full_tensor().shape == (full.shape if rank == 0 else (0,))


def test_torch_rebuilds_a_ragged_placement_as_shard():
    run_distributed(_worker, 2, timeout_s=120)
