"""Matrices split across ranks, orthogonalised once each: every split matrix has one owner rank
on its shard axis, chosen so that each rank's Newton-Schulz work is about equal (the owner
assignment of runtime/placement/owners.py, largest first). One all-to-all brings each owner the
pieces of its matrices, the owner orthogonalises them whole, and a second all-to-all takes each
rank's part of the results back: each matrix crosses the shard group twice, as torchtitan's
DistMuon moves it, instead of being gathered on every rank and orthogonalised there W times.
Both ways carry bfloat16, the dtype Newton-Schulz works in: its first step casts the whole
matrix to it (an elementwise cast, so casting each piece before it is sent gives the same bits)
and it returns its result in it; DistMuon carries fp32 both ways, twice these bytes.

A batch is the split matrices of one parameter group on one mesh with one shard axis (Shard(dim)
on that axis, Replicate on the others: the replicas of HSDP exchange alike and compute the same
result); the pieces of a matrix are concatenated along its shard dim in rank order, which is
what `full_tensor()` would give, bit for bit. A matrix split along several axes (FSDP x TP) is
gathered along all but one first (exchange_layout), so the TP ranks of one FSDP group each
exchange the same matrices over their own FSDP group, as HSDP's replicas do.

On the GPU path: the split sizes are computed from shapes on the host; the collectives are
torch.distributed's, waited for by the compute stream; no host sync.
"""
from __future__ import annotations

import functools
import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..runtime.placement.owners import assign_owners

# what torch's Newton-Schulz iteration works in: it casts its input to it first and returns it
# (torch/optim/_muon.py; tests/optim/test_muon.py fails if that changes)
NS_DTYPE = torch.bfloat16


def exchange_layout(placements, mesh_shape) -> tuple[int, tuple] | None:
    """(mesh axis, placements) a split matrix is exchanged in: its plain Shard(dim) axis over the
    most ranks (the first on a tie) stays split; every other split axis (FSDP x TP: the other
    Shard, or FSDP's _StridedShard over TP's rows) is gathered first (Replicate there), so the
    matrix is split along one axis and replicated along the rest, as under FSDP or HSDP. None
    where no axis is a plain Shard."""
    axes = [i for i, p in enumerate(placements) if type(p) is Shard]
    if not axes:
        return None
    axis = max(axes, key=lambda i: (mesh_shape[i], -i))
    return axis, tuple(p if i == axis else Replicate() for i, p in enumerate(placements))


def orthogonalised_parts(updates: list[DTensor], orthogonalise) -> list[torch.Tensor]:
    """This rank's part of each update's orthogonalised whole (DTensors split along one or more
    mesh axes), each whole matrix orthogonalised on its owner only: `orthogonalise` takes the
    list of whole matrices a rank owns and returns their results in that order. An update split
    along several axes is first gathered along all but one (exchange_layout; in bf16), and its
    part of the result cut back out of the gathered layout (a local narrowing)."""
    batches = defaultdict(list)
    laid = []
    for index, update in enumerate(updates):
        mesh = update.device_mesh
        axis, placements = exchange_layout(tuple(update.placements), tuple(mesh.shape))
        if placements != tuple(update.placements):
            update = update.to(NS_DTYPE).redistribute(mesh, placements)
        laid.append(update)
        batches[(id(mesh), axis)].append(index)
    parts: list[torch.Tensor | None] = [None] * len(updates)
    for (_, axis), indices in batches.items():
        done = _exchange([laid[i] for i in indices], axis, orthogonalise)
        for i, part in zip(indices, done):
            parts[i] = _as_split(part, laid[i], updates[i])
    return parts


def _as_split(part: torch.Tensor, laid: DTensor, update: DTensor) -> torch.Tensor:
    """This rank's part in `update`'s placements, from its part in the exchanged layout."""
    if laid.placements == update.placements:
        return part
    exchanged = DTensor.from_local(part, laid.device_mesh, laid.placements, run_check=False,
                                   shape=laid.shape, stride=laid.stride())
    return exchanged.redistribute(update.device_mesh, update.placements).to_local()


def _pieces(update: DTensor, axis: int, world: int) -> tuple[tuple[tuple[int, ...], int], ...]:
    """(shape, first index along the shard dim) of each shard rank's piece of `update` along mesh
    dim `axis` (its coordinates on the other, replicating, dims do not matter)."""
    return _pieces_of(tuple(update.shape), tuple(update.device_mesh.shape),
                      tuple(update.placements), axis, world)


@functools.lru_cache(maxsize=1024)
def _pieces_of(shape, mesh_shape, placements, axis: int, world: int):
    """_pieces from shapes alone (worked out once per kind of matrix, not every step)."""
    dim = placements[axis].dim
    pieces = []
    for index in range(world):
        coordinate = [0] * len(mesh_shape)
        coordinate[axis] = index
        piece_shape, offset = piece_of(shape, mesh_shape, coordinate, placements)
        pieces.append((piece_shape, offset[dim]))
    return tuple(pieces)


def piece_of(shape, mesh_shape, coordinate, placements) -> tuple[tuple, tuple]:
    """(shape, offset) of the part of a tensor of `shape` that the rank at `coordinate` holds
    under Shard/Replicate `placements`: torch.chunk's split (ceil(n / W) per rank, the last ones
    short or empty), mesh dims applied in order, as DTensor places it. Worked out in Python
    integers: torch's own helper builds index tensors and reads them back, a host read per call
    on the device it runs on."""
    size, offset = list(shape), [0] * len(shape)
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard):
            whole, dim = size[placement.dim], placement.dim
            chunk = -(-whole // mesh_shape[axis])
            start = min(coordinate[axis] * chunk, whole)
            size[dim] = min(whole, start + chunk) - start
            offset[dim] += start
    return tuple(size), tuple(offset)


@functools.lru_cache(maxsize=256)
def _owners(sizes: tuple[int, ...], world: int) -> tuple[int, ...]:
    """The owner of each matrix of a batch (the same batch every step: planned once)."""
    return tuple(assign_owners(list(sizes), world))


def _exchange(updates: list[DTensor], axis: int, orthogonalise) -> list[torch.Tensor]:
    mesh = updates[0].device_mesh
    group, world = mesh.get_group(axis), mesh.size(axis)
    me = mesh.get_local_rank(axis)
    owners = _owners(tuple(u.numel() for u in updates), world)
    pieces = [_pieces(u, axis, world) for u in updates]
    counts = [[math.prod(shape) for shape, _ in p] for p in pieces]
    dims = [u.placements[axis].dim for u in updates]
    owned = [[i for i, o in enumerate(owners) if o == d] for d in range(world)]
    # to the owners: to rank d, this rank's piece of each matrix d owns, in matrix order
    sent = [sum(counts[i][me] for i in owned[d]) for d in range(world)]
    got = [sum(counts[i][s] for i in owned[me]) for s in range(world)]
    send = _cat([updates[i].to_local().reshape(-1) for d in range(world) for i in owned[d]],
                NS_DTYPE, updates[0].device)
    received = send.new_empty(sum(got))
    dist.all_to_all_single(received, send, got, sent, group=group)
    # the owner's matrices whole (source s's block holds its piece of each, in matrix order),
    # orthogonalised; back to rank s goes its piece of each
    from_source = [iter(block.split([counts[i][s] for i in owned[me]]))
                   for s, block in enumerate(received.split(got))]
    wholes = [torch.cat([next(from_source[s]).view(pieces[i][s][0]) for s in range(world)],
                        dim=dims[i]) for i in owned[me]]
    results = dict(zip(owned[me], orthogonalise(wholes)))
    back = _cat([results[i].narrow(dims[i], pieces[i][s][1], pieces[i][s][0][dims[i]])
                 .reshape(-1) for s in range(world) for i in owned[me]], NS_DTYPE, send.device)
    mine = back.new_empty(sum(sent))
    dist.all_to_all_single(mine, back, sent, got, group=group)
    from_owner = [iter(block.split([counts[i][me] for i in owned[d]]))
                  for d, block in enumerate(mine.split(sent))]
    parts: list[torch.Tensor | None] = [None] * len(updates)
    for d in range(world):
        for i in owned[d]:
            parts[i] = next(from_owner[d]).view(pieces[i][me][0])
    return parts


def _cat(flats: list[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
    return torch.cat([f.to(dtype) for f in flats]) if flats else torch.empty(0, dtype=dtype,
                                                                              device=device)
