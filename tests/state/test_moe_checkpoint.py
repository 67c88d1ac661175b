"""fsdp_ext's save_checkpoint / load_checkpoint with expert-parallel parameters (the MoE example
at EP=2 on 2 ranks, sharded by torchtitan's apply_fsdp_to_decoder: tests/helpers/moe.py): the
optimizer state of a routed-expert weight, a DTensor whose global shape (all experts) is not the
shape fsdp_ext shards (this rank's experts), loads back as a DTensor like the parameter, and the
resumed run's losses equal the uninterrupted run's bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan.distributed.fsdp")

import fsdp_ext  # noqa: E402
from examples.moe import MoEDecoder  # noqa: E402

from ..helpers import moe as moe_scripts  # noqa: E402
from ..helpers.dist import run_distributed  # noqa: E402

CFG = moe_scripts.CFG_EP


def _build(world: int):
    model = MoEDecoder(CFG, seed=moe_scripts.SEED)
    model = moe_scripts.shard_with_torchtitan(model, "fsdp_ext", world, ep=2)
    return model, moe_scripts._optimizer(model)


def _steps(model, optimizer, first: int, count: int, rank: int, world: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        loss = model(*moe_scripts.batch(step, rank, world, CFG)) / world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _worker(rank: int, world: int, directory: str) -> None:
    model, optimizer = _build(world)
    _steps(model, optimizer, 0, 2, rank, world)
    fsdp_ext.save_checkpoint(directory, model, optimizer, 2)
    expected = _steps(model, optimizer, 2, 2, rank, world)
    model, optimizer = _build(world)
    assert fsdp_ext.load_checkpoint(directory, model, optimizer)[0] == 2
    expert = model.layers["1"].moe.routed_experts.inner_experts.w1
    state = optimizer.state[expert]["exp_avg"]
    assert type(state) is type(expert) and state.placements == expert.placements, type(state)
    assert state.shape == expert.shape == (4, CFG.dim, CFG.hidden_dim)
    assert _steps(model, optimizer, 2, 2, rank, world) == expected


@pytest.mark.slow  # 15 s: two ranks, torchtitan's import, eight steps
def test_expert_parallel_checkpoint_resumes_bit_for_bit(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))
