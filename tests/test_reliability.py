"""Hangs become errors: diverging ranks, a blocked rank and a dead rank each end every surviving
rank with an error naming the collective and unit, in bounded time.

Divergence runs under mp.spawn (every rank raises, so nothing is left to kill). Blocked and dead
ranks run as independent processes (tests/proc_launch.py): mp.spawn would kill the survivors on
the first failure and hide a hang.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_ext

from .dist_utils import run_distributed
from .proc_launch import Ranks


# ---- ranks that diverge -----------------------------------------------------------------------------
class Branchy(nn.Module):
    """Three blocks; `skip` names one the forward leaves out (a data-dependent branch)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x, skip=None):
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(block(x))
        return self.head(x)


class TwoHeads(nn.Module):
    """A trunk and two heads; which heads the loss uses decides which units run backward."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.a = nn.Linear(8, 2)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.a(h), self.b(h)


def _sharded(model: nn.Module, children) -> nn.Module:
    for child in children:
        fsdp_ext.fully_shard(child)
    return fsdp_ext.fully_shard(model)


def _diverged_lines(message: str) -> dict[int, str]:
    """rank -> what it was about to issue, from a CollectiveMismatchError message."""
    return {int(r): what for r, what in re.findall(r"^  rank (\d+): (.*)$", message, re.M)}


def check_skipped_unit_in_forward(rank: int, world_size: int, at_step: int) -> None:
    """The last rank skips blocks.1 at step `at_step` (0: first step; 1: with prefetch running)."""
    torch.manual_seed(0)
    model = Branchy()
    _sharded(model, model.blocks)
    x = torch.randn(4, 8)
    for _ in range(at_step):
        model(x).sum().backward()
    skip = 1 if rank == world_size - 1 else None
    with pytest.raises(fsdp_ext.CollectiveMismatchError) as info:
        model(x, skip=skip).sum().backward()
    lines = _diverged_lines(str(info.value))
    assert sorted(lines) == list(range(world_size)), str(info.value)
    assert str(info.value).startswith(f"rank {rank}: ranks diverged"), str(info.value)
    # The ranks that ran blocks.1 say so; the skipping rank names the unit it went to instead.
    for r in range(world_size - 1):
        assert "unit 'blocks.1'" in lines[r], str(info.value)
    assert "unit 'blocks.1'" not in lines[world_size - 1], str(info.value)


def check_divergence_in_backward(rank: int, world_size: int) -> None:
    """Same forward everywhere; the last rank's loss ignores head b, so its backward skips b."""
    torch.manual_seed(0)
    model = TwoHeads()
    _sharded(model, [model.a, model.b])
    ya, yb = model(torch.randn(4, 8))  # no error yet: the forwards agree
    loss = ya.sum() if rank == world_size - 1 else ya.sum() + yb.sum()
    with pytest.raises(fsdp_ext.CollectiveMismatchError) as info:
        loss.backward()
    lines = _diverged_lines(str(info.value))
    assert sorted(lines) == list(range(world_size)), str(info.value)
    for r in range(world_size - 1):
        assert "unit 'b'" in lines[r], str(info.value)
    assert "unit 'b'" not in lines[world_size - 1], str(info.value)


def check_matching_ranks_pass(rank: int, world_size: int) -> None:
    """The checks must not fire when ranks agree (data differs per rank, units do not)."""
    torch.manual_seed(0)
    model = Branchy()
    _sharded(model, model.blocks)
    for step in range(3):
        model(torch.randn(4, 8) + rank, skip=step % 3).sum().backward()


def divergence_worker(rank: int, world_size: int) -> None:
    check_matching_ranks_pass(rank, world_size)
    for at_step in (0, 1):
        check_skipped_unit_in_forward(rank, world_size, at_step)
    check_divergence_in_backward(rank, world_size)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_divergence_raises_on_every_rank(world_size):
    run_distributed(divergence_worker, world_size)


# ---- a rank that blocks or dies ---------------------------------------------------------------------
DEADLINE_S = 150  # launch to exit, imports included; the scripts' process-group timeout is 600 s
SURVIVOR_ERROR = re.compile(
    r"CollectiveError: rank (\d+): (?:(?:all_gather|reduce_scatter) of unit '[^']*'"
    r"|peers did not reach call #\d+: \w+ of unit '[^']*')")


def _assert_survivors_report(results: dict, world_size: int) -> list[str]:
    messages = []
    for rank in range(world_size - 1):
        result = results[rank]
        assert result.returncode is not None, (
            f"rank {rank} still running {DEADLINE_S} s after launch:\n{result.output[-3000:]}")
        assert result.returncode != 0, f"rank {rank} exited 0:\n{result.output[-3000:]}"
        match = SURVIVOR_ERROR.search(result.output)
        assert match and int(match.group(1)) == rank, result.output[-3000:]
        assert "DONE" not in result.output
        messages.append(result.output[match.start():].splitlines()[0])
    return messages


@pytest.mark.parametrize("fail_step,check_iterations,where", [
    (1, "2", "peers did not reach"),        # fingerprints on: blocked in the exchange
    (2, "0", "failed (collective_timeout 3 s)"),  # fingerprints off: blocked in a collective
], ids=["fingerprints-on", "fingerprints-off"])
def test_blocked_rank_times_out(fail_step, check_iterations, where):
    world_size = 2
    env = {"FSDP_EXT_COLLECTIVE_TIMEOUT_S": "3", "FSDP_EXT_CHECK_ITERATIONS": check_iterations}
    with Ranks(["tests/fault_script.py", "--mode", "sleep", "--fail-step", str(fail_step)],
               world_size, env) as ranks:
        results = ranks.wait(range(world_size - 1), DEADLINE_S)
        messages = _assert_survivors_report(results, world_size)
        assert all(where in m for m in messages), messages
        sleeper = ranks.wait([world_size - 1], 0)[world_size - 1]
        assert sleeper.returncode is None, "the sleeping rank should still be asleep"


@pytest.mark.parametrize("mode,world_size,exit_code", [
    ("kill", 2, -9),     # SIGKILL in forward
    ("exit", 3, 7),      # os._exit in backward
    ("raise", 2, 1),     # an exception in backward, left uncaught
], ids=["sigkill-forward", "exit-backward", "raise-backward"])
def test_dead_rank_ends_survivors(mode, world_size, exit_code):
    with Ranks(["tests/fault_script.py", "--mode", mode, "--fail-step", "2"], world_size) as ranks:
        results = ranks.wait(range(world_size), DEADLINE_S)
        assert results[world_size - 1].returncode == exit_code, results[world_size - 1].output
        _assert_survivors_report(results, world_size)


# ---- the checkpoint a dead rank leaves behind -------------------------------------------------------
def _reference_losses(steps: int) -> list[float]:
    """The unwrapped model trained in this process on the whole batch: the uninterrupted run."""
    from .fault_script import build_model, loss_of, make_batch, make_optimizer
    model = build_model()
    optimizer = make_optimizer(model)
    losses = []
    for step in range(steps):
        loss = loss_of(model, *make_batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _mean_losses(results: dict) -> dict[int, float]:
    """step -> mean over ranks of the printed local losses (= the global batch's loss)."""
    per_step: dict[int, list[float]] = {}
    for result in results.values():
        for step, value in re.findall(r"^LOSS (\d+) (\S+)$", result.output, re.M):
            per_step.setdefault(int(step), []).append(float(value))
    return {step: sum(v) / len(v) for step, v in per_step.items() if len(v) == len(results)}


def test_rank_killed_during_save_then_resume(tmp_path):
    """Rank 1 of 2 is SIGKILLed inside the save of step-3 (its shards written, nothing published):
    rank 0 exits with an error, `latest` still names step-2, and a run at world 3 resumed from it
    reproduces the uninterrupted run's losses."""
    directory = str(tmp_path)
    steps = 5
    expected = _reference_losses(steps)
    args = ["tests/fault_script.py", "--steps", str(steps), "--ckpt-dir", directory]
    with Ranks(args + ["--mode", "kill_in_save", "--fail-step", "3"], 2) as ranks:
        results = ranks.wait(range(2), DEADLINE_S)
    assert results[1].returncode == -9, results[1].output[-3000:]
    survivor = results[0]
    assert survivor.returncode not in (None, 0), survivor.output[-3000:]
    assert "save_checkpoint" in survivor.output and re.search(
        r"Connection (closed|reset) by peer", survivor.output), survivor.output[-3000:]
    with open(f"{directory}/latest") as f:
        assert f.read().strip() == "step-2"
    assert not (tmp_path / "step-3").exists(), "a checkpoint was published without rank 1"
    with Ranks(args + ["--resume"], 3) as ranks:
        resumed = ranks.wait(range(3), DEADLINE_S)
    for rank, result in resumed.items():
        assert result.returncode == 0 and "RESUMED 2" in result.output, result.output[-3000:]
    losses = _mean_losses(resumed)
    assert sorted(losses) == [2, 3, 4], losses
    losses.update(_mean_losses(results))  # steps 0-2 of the failed run (both ranks printed them)
    assert sorted(losses) == [0, 1, 2, 3, 4], losses
    for step, value in losses.items():
        assert value == pytest.approx(expected[step], rel=1e-5, abs=1e-6), (step, losses, expected)
