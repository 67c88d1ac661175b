"""Property-based parity: random module trees (depth, prime widths, unit boundaries, frozen
subsets, tied pairs, fp32 + bf16 in one unit) train identically sharded and unsharded.

Hypothesis draws the specs once in the test process (derandomized: the same examples every run);
one launch per world size runs them all, since each launch costs seconds. A failure lists every
failing spec as JSON: rebuild it with tests.helpers.random_models.RandomModel(spec) to investigate.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings

import fsdp_ext

from ..helpers.dist import global_mean, local_slice, run_distributed
from ..helpers.random_models import OUT_DIM, RandomModel, count_nodes, has_bf16, model_specs, shard_as_specified

EXAMPLES = 30  # drawn; duplicates (hypothesis starts from minimal examples) are run once
STEPS = 3


def draw_specs(n: int = EXAMPLES) -> list[dict]:
    specs: dict[str, dict] = {}

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(model_specs())
    def collect(spec):
        specs.setdefault(json.dumps(spec, sort_keys=True), spec)

    collect()
    return list(specs.values())


def run_spec(spec: dict, rank: int, world_size: int) -> None:
    reference = RandomModel(spec)
    model = shard_as_specified(copy.deepcopy(reference))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    # bf16 weights get bf16 gradients rounded per rank before the sum (the reference rounds the
    # whole-batch sum once): one-ulp differences there feed the fp32 weights' later gradients.
    mixed = has_bf16(spec)
    loss_tol = dict(atol=1e-3, rtol=1e-2) if mixed else dict(atol=1e-6, rtol=1e-5)
    param_tol = dict(atol=1e-3, rtol=1e-2) if mixed else dict(atol=1e-5, rtol=1e-4)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2 * world_size, spec["in_dim"], generator=g)
        y = torch.randn(2 * world_size, OUT_DIM, generator=g)
        loss = ((model(local_slice(x, rank, world_size)) - local_slice(y, rank, world_size)) ** 2).mean()
        loss.backward()
        no_grad = {n for n, p in model.named_parameters() if p.grad is None}
        opt.step()
        opt.zero_grad()
        ref_loss = ((reference(x) - y) ** 2).mean()
        ref_loss.backward()
        ref_no_grad = {n for n, p in reference.named_parameters() if p.grad is None}
        ref_opt.step()
        ref_opt.zero_grad()
        assert no_grad == ref_no_grad, f"step {step}: grad None for {no_grad}, reference {ref_no_grad}"
        torch.testing.assert_close(global_mean(loss), ref_loss.detach(), **loss_tol,
                                   msg=lambda m: f"step {step} loss: {m}")
    full = fsdp_ext.full_state_dict(model)
    expected = reference.state_dict()
    assert list(full) == list(expected), f"keys {list(full)} != {list(expected)}"
    for key, value in expected.items():
        tol = dict(atol=1e-5, rtol=1.6e-2) if value.dtype == torch.bfloat16 else param_tol
        torch.testing.assert_close(full[key], value, **tol, msg=lambda m: f"{key}: {m}")


def parity_worker(rank: int, world_size: int, specs: list[dict]) -> None:
    failures = []
    for index, spec in enumerate(specs):
        try:
            run_spec(spec, rank, world_size)
        except AssertionError as exc:  # same on every rank (global losses, gathered parameters)
            failures.append(f"spec {index} {json.dumps(spec)}:\n  {exc}")
    if failures:
        raise AssertionError(f"rank {rank}, world {world_size}: {len(failures)} of {len(specs)} "
                             "specs differ from the reference:\n" + "\n".join(failures))
    dist.barrier()


def test_specs_cover_the_space():
    """The derandomized draw really contains what the test claims to exercise."""
    specs = draw_specs()
    nodes = []

    def walk(node, depth):
        nodes.append((node, depth))
        for child in node["children"]:
            walk(child, depth + 1)

    for spec in specs:
        walk(spec["root"], 0)
    assert len(specs) >= EXAMPLES * 2 // 3, f"only {len(specs)} distinct specs"
    assert max(d for _, d in nodes) >= 2, "no nested units"
    assert any(n["frozen"] for n, _ in nodes) and any(n["tied"] for n, _ in nodes)
    assert any(n["gain_bf16"] for n, _ in nodes) and any(not has_bf16(s) for s in specs)
    assert any(n["shard"] for n, _ in nodes) and any(not n["shard"] for n, _ in nodes)
    assert {7, 11, 13} & {n["width"] for n, _ in nodes}, "no prime widths"
    assert max(count_nodes(s) for s in specs) >= 4


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_random_trees_match_reference(world_size):
    run_distributed(parity_worker, world_size, draw_specs())
