"""The MoE example (examples/moe.py) sharded by torchtitan 0.3.0's `apply_fsdp_to_decoder` at EP=1
(tests/helpers/moe.py): with torch's FSDP2 its losses, every step's gradients and the trained
parameters equal the unwrapped model's within fp32 round-off, at world 2 (every parameter
`Shard(0)`) and world 4 (layer 2's 3 experts `Shard(1)`, layer 1's 4 experts `Shard(0)`). The
same with fsdp_ext's `fully_shard` swapped in, whose losses and trained parameters also equal
torch's on the same script.

With expert parallelism (examples/moe_ep.py, EP=2 at world 4 over a (efsdp, ep) mesh; the routed
experts FSDP-sharded over efsdp: layer 1's 4 experts `_StridedShard(dim=0, sf=2), Shard(0)`, layer
2's 2 experts `Shard(1), Shard(0)`), fsdp_ext's run equals torch's FSDP2's on the same AdamW
script (bit for bit when last run; the test allows fp32 round-off), and the unwrapped model's
under plain SGD. Not under AdamW: its first update of an element whose
gradient lies below its eps (1e-8) is about lr * g / eps, so a gradient of 1e-9 that summation
order moves by 1e-9 (one element of layer 0's attention output, here) moves that parameter by
5e-4, and top-k routing carries it on; torch's FSDP2 itself then parts from the unwrapped model by
1e-3 in a gradient within 4 steps at EP=2 (and beyond compare's tolerances at EP=1 on this config
too), while SGD's stay within 3e-8."""
from __future__ import annotations

import types

import pytest

pytest.importorskip("torchtitan.distributed.fsdp")

from examples.moe import MoEDecoder, RoutedExperts  # noqa: E402
from examples.moe_ep import apply_expert_parallel  # noqa: E402

from ..helpers import moe as moe_scripts  # noqa: E402

EXPERTS = ("w1", "w2", "w3")
EP_EXPERTS = {"1": "_StridedShard(dim=0, sf=2), Shard(0)", "2": "Shard(1), Shard(0)"}


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
@pytest.mark.essential
def test_torch_fsdp2_through_torchtitan_matches_unwrapped_world4():
    _check_against_reference("torch", 4, {"1": "Shard(0)", "2": "Shard(1)"})


def test_fsdp_ext_through_torchtitan_matches_unwrapped_world2():
    _check_against_reference("fsdp_ext", 2, {"1": "Shard(0)", "2": "Shard(0)"})


@pytest.mark.slow
@pytest.mark.essential
def test_fsdp_ext_through_torchtitan_matches_unwrapped_and_torch_world4():
    ours = _check_against_reference("fsdp_ext", 4, {"1": "Shard(0)", "2": "Shard(1)"})
    theirs = moe_scripts.train_sharded("torch", 4)
    assert moe_scripts.compare(ours, theirs) is None


def test_expert_parallel_refuses_an_expert_count_it_does_not_divide():
    """Refused before anything changes; the check reads only the mesh's size, so a stand-in with
    `size()` serves (no process group)."""
    model = MoEDecoder(moe_scripts.CFG)   # MoE blocks of 4 and 3 experts
    with pytest.raises(ValueError, match=r"multiple of 2; MoE block 1 has 3 experts"):
        apply_expert_parallel(model, types.SimpleNamespace(size=lambda: 2))
    assert all(type(m.routed_experts) is RoutedExperts for m in model.moe_layers())


def _check_expert_parallel_run(result: dict) -> None:
    assert result["units"] == 7
    assert _expert_placements(result) == EP_EXPERTS
    others = {p for n, p in result["placements"].items() if "inner_experts" not in n}
    assert others == {"Shard(0)"}


@pytest.mark.slow
@pytest.mark.essential
def test_fsdp_ext_expert_parallel_matches_unwrapped_world4():
    ours = moe_scripts.train_sharded("fsdp_ext", 4, moe_scripts.CFG_EP, ep=2,
                                     optimizer_kind="sgd")
    _check_expert_parallel_run(ours)
    reference = moe_scripts.train_reference(4, moe_scripts.CFG_EP, optimizer_kind="sgd")
    assert moe_scripts.compare(ours, reference) is None


@pytest.mark.slow
@pytest.mark.essential
def test_fsdp_ext_expert_parallel_matches_torch_world4():
    ours = moe_scripts.train_sharded("fsdp_ext", 4, moe_scripts.CFG_EP, ep=2)
    theirs = moe_scripts.train_sharded("torch", 4, moe_scripts.CFG_EP, ep=2)
    _check_expert_parallel_run(ours)
    assert ours["placements"] == theirs["placements"]
    assert moe_scripts.compare(ours, theirs) is None
    assert ours["losses"][-1] < ours["losses"][0]   # it trains


def test_train_refuses_expert_parallel_it_cannot_run():
    """examples/train.py's --ep checks (before any process group is needed)."""
    from examples import train

    def refusal(*argv: str, world: int = 4) -> str:
        return "; ".join(train.expert_parallel_problems(train.parse_args(list(argv)), world))
    assert "--model moe" in refusal("--ep", "2")
    assert "(got 4 ranks)" in refusal("--model", "moe", "--experts", "6", "--ep", "3")
    assert "(got --experts 3)" in refusal("--model", "moe", "--experts", "3", "--ep", "2")
    assert "(got fully_shard/HYBRID_SHARD)" in refusal("--model", "moe", "--ep", "2",
                                                       "--sharding-strategy", "HYBRID_SHARD")
    assert "(got fsdp1/FULL_SHARD)" in refusal("--model", "moe", "--ep", "2", "--api", "fsdp1")
    assert refusal("--model", "moe", "--experts", "4", "--ep", "2") == ""
