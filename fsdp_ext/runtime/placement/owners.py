"""Which rank owns which whole matrix: the assignment whole-matrix placements need so that every
rank's part of a unit stays about the same size.

A unit's all-gather carries one equal-sized piece per rank; with whole matrices per rank, a piece
is the sum of the matrices its rank owns, padded to the largest piece. `assign_owners` keeps the
largest piece small with the longest-processing-time rule (largest matrix first, to the rank
holding least so far; Graham 1969: within 4/3 of the best); `padding` is what the pieces carry
beyond the matrices. No assignment can pad less than `world * largest matrix - total` where one
matrix outweighs a rank's fair share: benchmarks/planner/owner_padding.py reports both on real
model shapes, beside an exact search.
"""
from __future__ import annotations


def assign_owners(sizes: list[int], world: int) -> list[int]:
    """The owner rank of each matrix (`sizes`: element counts), largest first to the rank holding
    least so far (the lower rank on a tie): alike on every rank, as it must be."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    loads = [0] * world
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


def loads_of(sizes: list[int], owners: list[int], world: int) -> list[int]:
    """Each rank's piece: the elements of the matrices it owns."""
    loads = [0] * world
    for size, owner in zip(sizes, owners):
        loads[owner] += size
    return loads


def padding(sizes: list[int], owners: list[int], world: int) -> int:
    """Elements the all-gather carries beyond the matrices: every piece padded to the largest."""
    loads = loads_of(sizes, owners, world)
    return world * max(loads) - sum(sizes)
