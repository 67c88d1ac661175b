"""The MoE example (examples/moe.py) sharded by torchtitan 0.3.0's `apply_fsdp_to_decoder` at EP=1
(tests/moe_scripts.py): with torch's FSDP2 its losses, every step's gradients and the trained
parameters equal the unwrapped model's within fp32 round-off, at world 2 (every parameter
`Shard(0)`) and world 4 (layer 2's 3 experts `Shard(1)`, layer 1's 4 experts `Shard(0)`). The
same with fsdp_ext's `fully_shard` swapped in, whose losses and trained parameters also equal
torch's on the same script."""
from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.distributed.fsdp")

from . import moe_scripts  # noqa: E402

EXPERTS = ("w1", "w2", "w3")


def _expert_placements(result: dict) -> dict[str, str]:
    """{"1": placement of layer 1's experts, ...}; every expert weight of a layer alike."""
    found = {}
    for name, placement in result["placements"].items():
        parts = name.split(".")
        if "inner_experts" in parts and parts[-1] in EXPERTS:
            found.setdefault(parts[1], set()).add(placement)
    assert all(len(p) == 1 for p in found.values()), found
    return {layer: p.pop() for layer, p in found.items()}


def _check_against_reference(impl: str, world_size: int, expected_experts: dict) -> dict:
    result = moe_scripts.train_sharded(impl, world_size)
    # FSDPModules: tok_embeddings, norm and lm_head (one list unit, each member an FSDPModule),
    # the three blocks and the root
    assert result["units"] == 7
    assert _expert_placements(result) == expected_experts
    others = {p for n, p in result["placements"].items() if "inner_experts" not in n}
    assert others == {"Shard(0)"}
    reference = moe_scripts.train_reference(world_size)
    assert moe_scripts.compare(result, reference) is None
    assert result["losses"][-1] < result["losses"][0]   # it trains
    return result


def test_torch_fsdp2_through_torchtitan_matches_unwrapped_world2():
    _check_against_reference("torch", 2, {"1": "Shard(0)", "2": "Shard(0)"})


@pytest.mark.slow
def test_torch_fsdp2_through_torchtitan_matches_unwrapped_world4():
    _check_against_reference("torch", 4, {"1": "Shard(0)", "2": "Shard(1)"})


def test_fsdp_ext_through_torchtitan_matches_unwrapped_world2():
    _check_against_reference("fsdp_ext", 2, {"1": "Shard(0)", "2": "Shard(0)"})


@pytest.mark.slow
def test_fsdp_ext_through_torchtitan_matches_unwrapped_and_torch_world4():
    ours = _check_against_reference("fsdp_ext", 4, {"1": "Shard(0)", "2": "Shard(1)"})
    theirs = moe_scripts.train_sharded("torch", 4)
    assert moe_scripts.compare(ours, theirs) is None
