"""Opt-in check that gradients are finite, at each bucket's reduce-scatter (`check_finite_grads`).

A NaN/Inf produced on one rank reaches, through the reduce-scatter, only the ranks owning the
elements it touches, so a purely local check would make some ranks raise while the others wait in
their next collective. Instead each rank flags, per parameter, whether the gradient it sends is
finite (no host sync: the flags stay tensors), and one tiny all-reduce of a [world, parameters]
table, issued in the same order on every rank, lets every rank raise the same error at the same
point, naming the unit, the parameters and the ranks whose backward produced them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.errors import NonFiniteGradientError


def merge_flags(flags: torch.Tensor | None, grads, device: torch.device) -> torch.Tensor:
    """OR this micro-batch's per-parameter "not finite" flags (int32 [len(grads)]) into `flags`."""
    zero = torch.zeros((), dtype=torch.bool, device=device)
    new = torch.stack([zero if g is None else ~torch.isfinite(g).all().to(device) for g in grads])
    new = new.to(torch.int32)
    return new if flags is None else flags | new


def raise_if_nonfinite(unit, bucket, flags: torch.Tensor) -> None:
    """Exchange the flags of every data-parallel rank; raise naming unit, parameters and ranks."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    table = torch.zeros(world, flags.numel(), dtype=torch.int32, device=flags.device)
    table[rank] = flags
    # Rows are disjoint per rank, so summing over the shard group and then over the replicas
    # (HSDP) gives every rank the whole table.
    for group in (bucket.groups.shard, bucket.groups.replicate):
        if group is not None:
            dist.all_reduce(table, group=group)
    if not bool(table.any()):
        return
    bad = []
    index = unit.buckets.index(bucket)
    for j, slot in enumerate(bucket.slots):
        ranks = table[:, j].nonzero().flatten().tolist()
        if ranks:
            name = unit.param_name(slot)
            bad.append(f"'{name}' (rank{'s' if len(ranks) > 1 else ''} "
                       f"{', '.join(map(str, ranks))})")
    raise NonFiniteGradientError(
        f"rank {rank}: non-finite gradient (NaN/Inf) in unit '{unit.name or '<root>'}' bucket "
        f"{index}, before its reduce-scatter, for parameter(s) {', '.join(bad)}")
