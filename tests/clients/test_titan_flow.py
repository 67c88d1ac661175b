"""examples/titan_flow.py (torchtitan's Llama flow: meta-device build, apply_fsdp with prefetch
lists, to_empty + init_weights, torch's clip_grad_norm_, DCP checkpoints through get_state_dict /
set_state_dict) run with torch's FSDP2 and with fsdp_ext, only the switch changed, at world 2 and
3: the same losses every step; resuming from either's step-3 checkpoint continues both runs'
losses (fsdp_ext resumes from torch's checkpoint and from its own)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from examples.titan_flow import train

from ..helpers.dist import run_distributed

# torchtitan's flow (a client) at another size: slow, and a case CI must run (conftest.py).
SLOW_ESSENTIAL = (pytest.mark.slow, pytest.mark.essential)

TOL = dict(atol=1e-5, rtol=1e-5)


def _global(losses: list[float]) -> torch.Tensor:
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return t / dist.get_world_size()


def worker(rank: int, world: int, directory: str) -> None:
    runs = {}
    for name in ("torch", "fsdp_ext"):
        out = os.path.join(directory, name)
        runs[name] = _global(train(name, 6, out, checkpoint_at=3))
    torch.testing.assert_close(runs["fsdp_ext"], runs["torch"], **TOL)
    for source in ("fsdp_ext", "torch"):
        resumed = _global(train("fsdp_ext", 6, directory,
                                resume_from=os.path.join(directory, source, "step-3")))
        torch.testing.assert_close(resumed, runs["torch"][3:], **TOL,
                                   msg=lambda m: f"resumed from {source}'s checkpoint: {m}")
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=SLOW_ESSENTIAL)])
def test_titan_flow_matches_torch_fsdp2(world_size, tmp_path):
    run_distributed(worker, world_size, str(tmp_path), timeout_s=240)
