"""runtime/placement/owners.py, the owner of each whole matrix: every rank computes the same
assignment, equal matrices spread evenly, and on small random sets the largest piece stays within
Graham's 4/3 of the exact optimum (benchmarks/planner/owner_padding.py's search), which it
reaches on the model shapes that benchmark reports."""
from __future__ import annotations

import random

from benchmarks.planner.owner_padding import MODELS, exact_min_padding
from fsdp_ext.runtime.placement.owners import assign_owners, loads_of, padding


def test_equal_matrices_spread_evenly_and_ties_go_to_the_lower_rank():
    assert assign_owners([5] * 6, 3) == [0, 1, 2, 0, 1, 2]
    assert loads_of([5] * 6, assign_owners([5] * 6, 3), 3) == [10, 10, 10]
    assert padding([5] * 6, assign_owners([5] * 6, 3), 3) == 0
    assert assign_owners([1, 9, 4], 2) == [1, 0, 1]  # 9 first to rank 0, then 4 and 1 to rank 1


def test_one_matrix_larger_than_a_fair_share_sets_the_padding():
    sizes = [100, 10, 10]
    assert padding(sizes, assign_owners(sizes, 4), 4) == 4 * 100 - 120


def test_within_four_thirds_of_the_exact_largest_piece():
    rng = random.Random(0)
    for _ in range(200):
        world = rng.randint(2, 4)
        sizes = [rng.randint(1, 100) for _ in range(rng.randint(1, 9))]
        ours = max(loads_of(sizes, assign_owners(sizes, world), world))
        best = (exact_min_padding(sizes, world) + sum(sizes)) // world
        assert best <= ours <= 4 * best / 3, (sizes, world, ours, best)


def test_the_exact_optimum_on_one_block_of_each_model():
    for name, block in MODELS.items():
        if len(block) > 20:
            continue  # (the MoE block: hundreds of experts, beyond the exact search)
        for world in (2, 4, 8):
            assert padding(block, assign_owners(block, world), world) == \
                exact_min_padding(block, world), (name, world)
