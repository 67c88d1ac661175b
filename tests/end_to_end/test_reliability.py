"""Hangs become errors: diverging ranks, a blocked rank and a dead rank each end every surviving
rank with an error naming the collective and unit, in bounded time.

Divergence runs under mp.spawn (every rank raises, so nothing is left to kill). Blocked and dead
ranks run as independent processes (tests/helpers/launch.py): mp.spawn would kill the survivors on
the first failure and hide a hang.
"""
from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_ext
from fsdp_ext.diagnostics import host_syncs
from fsdp_ext.diagnostics.stream_check import stream_check
from fsdp_ext.env import CHECK as CHECK_ENV

from ..helpers.dist import run_distributed
from ..helpers.launch import Ranks

# The fault paths at other sizes: slow, and cases CI must run (tests/conftest.py: essential).
SLOW_ESSENTIAL = (pytest.mark.slow, pytest.mark.essential)


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


def _sharded(model: nn.Module, children, group, **kwargs) -> nn.Module:
    for child in children:
        fsdp_ext.fully_shard(child, process_group=group, **kwargs)
    return fsdp_ext.fully_shard(model, process_group=group, **kwargs)


def _fresh_group(world_size: int):
    """A process group of its own for each scenario: after a mismatch, collectives that paired
    with the wrong partner may still be in flight on the scenario's group (the run would end
    there); the short timeout ends them."""
    return dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=20))


def _accounts(message: str) -> dict[int, str]:
    """rank -> the collective it was at, from a CollectiveMismatchError message."""
    return {int(r): what for r, what in re.findall(r"^  rank (\d+): (.*)$", message, re.M)}


def _expect_divergence(rank: int, world_size: int, run, unit: str) -> None:
    """`run()` must raise CollectiveMismatchError on every rank within 60 s, with every rank's
    account; the last rank (the divergent one) must stand apart from the others, which agree, and
    a unit whose name starts with `unit` must be named on one side."""
    start = time.monotonic()
    with pytest.raises(fsdp_ext.CollectiveMismatchError) as info:
        run()
    message = str(info.value)
    assert time.monotonic() - start < 60, message
    accounts = _accounts(message)
    assert sorted(accounts) == list(range(world_size)), message
    assert "no account" not in message, message
    assert message.startswith(f"rank {rank}: ranks diverged"), message
    last = accounts[world_size - 1]
    others = {accounts[r] for r in range(world_size - 1)}
    assert len(others) == 1 and last not in others, message
    assert f"unit '{unit}" in last or f"unit '{unit}" in next(iter(others)), message


def check_skipped_unit_in_forward(rank: int, world_size: int, at_step: int) -> None:
    """The last rank skips blocks.1 at step `at_step` (0: first step; later: prefetch running)."""
    torch.manual_seed(0)
    model = Branchy()
    _sharded(model, model.blocks, _fresh_group(world_size))
    x = torch.randn(4, 8)
    for _ in range(at_step):
        model(x).sum().backward()
    skip = 1 if rank == world_size - 1 else None
    _expect_divergence(rank, world_size, lambda: model(x, skip=skip).sum().backward(),
                       "blocks.1")


def check_swapped_units(rank: int, world_size: int, **shard_kwargs) -> None:
    """At step 3 the last rank runs blocks.2 before blocks.1: equal sizes, so the collectives
    match in shape and would exchange each other's data without the tags."""
    torch.manual_seed(0)
    model = Branchy()
    _sharded(model, model.blocks, _fresh_group(world_size), **shard_kwargs)
    x = torch.randn(4, 8)
    for _ in range(3):
        model(x).sum().backward()

    def swapped():
        h = torch.tanh(model.blocks[0](x))
        if rank == world_size - 1:
            h = torch.tanh(model.blocks[1](torch.tanh(model.blocks[2](h))))
        else:
            h = torch.tanh(model.blocks[2](torch.tanh(model.blocks[1](h))))
        model.head(h).sum().backward()
    # Called outside the root's forward, so the root unit is gathered by hand first (as a
    # registered method would).
    model.unshard()
    _expect_divergence(rank, world_size, swapped, "blocks.")


def check_extra_micro_batch(rank: int, world_size: int) -> None:
    """Gradient accumulation: the last rank runs one more no-sync micro-batch than the others."""
    torch.manual_seed(0)
    model = Branchy()
    _sharded(model, model.blocks, _fresh_group(world_size))
    x = torch.randn(4, 8)
    model(x).sum().backward()

    def accumulate():
        micro = 3 if rank == world_size - 1 else 2
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            model(x).sum().backward()
    _expect_divergence(rank, world_size, accumulate, "blocks.")


def check_divergence_in_backward(rank: int, world_size: int) -> None:
    """Same forward everywhere; the last rank's loss ignores head b (a detached branch), so its
    backward never reaches b."""
    torch.manual_seed(0)
    model = TwoHeads()
    _sharded(model, [model.a, model.b], _fresh_group(world_size))
    for _ in range(2):
        ya, yb = model(torch.randn(4, 8))
        (ya.sum() + yb.sum()).backward()
    ya, yb = model(torch.randn(4, 8))  # no error yet: the forwards agree
    loss = ya.sum() if rank == world_size - 1 else ya.sum() + yb.sum()
    _expect_divergence(rank, world_size, loss.backward, "b")


def check_matching_ranks_pass(rank: int, world_size: int) -> None:
    """The checks must not fire when ranks agree (data differs per rank, units do not)."""
    torch.manual_seed(0)
    model = Branchy()
    _sharded(model, model.blocks, _fresh_group(world_size))
    for step in range(30):
        model(torch.randn(4, 8) + rank, skip=step % 3).sum().backward()


def divergence_worker(rank: int, world_size: int) -> None:
    check_matching_ranks_pass(rank, world_size)
    for at_step in (0, 2, 20):
        check_skipped_unit_in_forward(rank, world_size, at_step)
    check_swapped_units(rank, world_size)
    check_extra_micro_batch(rank, world_size)
    check_divergence_in_backward(rank, world_size)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=SLOW_ESSENTIAL)])
def test_divergence_raises_on_every_rank(world_size):
    run_distributed(divergence_worker, world_size)


def _runtime_syncs(model, scenario: str) -> tuple[int, int]:
    """(host syncs the runtime made in `scenario`'s steady-state steps, at any site; those
    steps): what the device-tag checks promise is a count per step, wherever the wait lives."""
    syncs = [r for r in model.syncs.steady() if r.origin == "runtime" and r.scenario == scenario]
    return len(syncs), len(model.syncs.steps[scenario])


def device_tags_worker(rank: int, world_size: int) -> None:
    """The accelerator path (side streams, under the stream-order model on CPU): tags compared
    on the device and read once per step. Ranks that agree pass with one host sync per step (the
    flags' read); swapped units raise the same CollectiveMismatchError on every rank, at the end
    of the backward. FSDP_EXT_CHECK=sync brings back the host check at every collective."""
    with stream_check(raise_on_exit=False) as model:
        with model.syncs.label("agree"):
            check_matching_ranks_pass(rank, world_size)
        with model.syncs.label("swapped"):
            # Without prefetch and without regathers in backward both orders issue the same
            # kinds of collectives in the same places: the model runs them on the host, where a
            # mismatched kind would block in gloo (a GPU's streams would queue it, and
            # read_flags' bounded wait would find the flags that did arrive).
            check_swapped_units(rank, world_size, forward_prefetch=0, backward_prefetch=0,
                                reshard_after_forward=False)
        os.environ[CHECK_ENV] = "sync"
        try:
            with model.syncs.label("sync"):
                check_matching_ranks_pass(rank, world_size)
        finally:
            del os.environ[CHECK_ENV]
    # Agreeing ranks: one host wait per step (the flags' read), whichever function makes it.
    syncs, steps = _runtime_syncs(model, "agree")
    assert steps >= 28 and syncs == steps, (syncs, steps)
    agree = {key: rate for key, rate in model.syncs.per_step().items() if key[0] == "agree"}
    assert not host_syncs.over_allowance(agree), agree
    # FSDP_EXT_CHECK=sync: the host checks every collective (at least the 3 per step here).
    syncs, steps = _runtime_syncs(model, "sync")
    assert steps >= 28 and syncs >= 3 * steps, (syncs, steps)
    dist.barrier()


@pytest.mark.stream_check
def test_divergence_raises_on_every_rank_with_device_tags():
    run_distributed(device_tags_worker, 2)


def planted_host_wait_worker(rank: int, world_size: int) -> None:
    """The count above can fail: a host read planted in every all-gather's wait (a function the
    count does not name) makes the runtime's syncs per step more than one."""
    from fsdp_ext.runtime.unit.unit import Unit
    original = Unit.wait_unshard

    def wait_unshard(self):
        original(self)
        if self.unsharded and self.buckets:
            self.buckets[0].full_data.sum().item()  # planted
    Unit.wait_unshard = wait_unshard
    try:
        with stream_check(raise_on_exit=False) as model:
            with model.syncs.label("agree"):
                check_matching_ranks_pass(rank, world_size)
    finally:
        Unit.wait_unshard = original
    syncs, steps = _runtime_syncs(model, "agree")
    assert steps >= 28 and syncs > steps, (syncs, steps)
    dist.barrier()


@pytest.mark.stream_check
def test_host_wait_count_fails_on_a_planted_wait():
    run_distributed(planted_host_wait_worker, 2)


# ---- a rank that blocks or dies ---------------------------------------------------------------------
DEADLINE_S = 150  # launch to exit, imports included; the scripts' process-group timeout is 600 s
SURVIVOR_ERROR = re.compile(
    r"CollectiveError: rank (\d+): (?:(?:all_gather|reduce_scatter) of unit '[^']*'"
    r"|peers did not (?:reach|finish) (?:all_gather|reduce_scatter|all_reduce) #\d+ of unit "
    r"'[^']*')")


def _assert_survivors_report(results: dict, world_size: int, budget_s: float = 60.0) -> list[str]:
    """Every rank but the last exits with a CollectiveError naming itself and the collective,
    within `budget_s` of launch (imports included); returns their messages (first lines and the
    per-rank lines below them)."""
    messages = []
    for rank in range(world_size - 1):
        result = results[rank]
        assert result.returncode is not None, (
            f"rank {rank} still running {DEADLINE_S} s after launch:\n{result.output[-3000:]}")
        assert result.returncode != 0, f"rank {rank} exited 0:\n{result.output[-3000:]}"
        assert result.seconds < budget_s, (result.seconds, result.output[-3000:])
        match = SURVIVOR_ERROR.search(result.output)
        assert match and int(match.group(1)) == rank, result.output[-3000:]
        assert "DONE" not in result.output
        messages.append(result.output[match.start():])
    return messages


def _names_last_rank(message: str, world_size: int, how: str = "gone: no heartbeat") -> bool:
    last = world_size - 1
    return (f"rank(s) [{last}] stopped issuing collectives" in message
            and f"  rank {last}: {how}" in message and "; last record: iteration" in message)


@pytest.mark.parametrize("fail_step,checks,where", [
    (1, "on", "peers did not reach"),                  # tags on: blocked on a tag
    pytest.param(2, "off", "failed (collective_timeout 3 s)",  # tags off: blocked in a collective
                 marks=SLOW_ESSENTIAL),
], ids=["tags-on", "tags-off"])
def test_blocked_rank_times_out(fail_step, checks, where):
    world_size = 2
    env = {"FSDP_EXT_COLLECTIVE_TIMEOUT_S": "3", "FSDP_EXT_CHECK": checks}
    with Ranks(["tests/helpers/fault_job.py", "--mode", "sleep", "--fail-step", str(fail_step)],
               world_size, env) as ranks:
        results = ranks.wait(range(world_size - 1), DEADLINE_S)
        messages = _assert_survivors_report(results, world_size)
        assert all(where in m for m in messages), messages
        if checks == "on":  # the sleeper is named, with where it last was
            assert all(_names_last_rank(m, world_size, "alive, in its own code")
                       for m in messages), messages
        sleeper = ranks.wait([world_size - 1], 0)[world_size - 1]
        assert sleeper.returncode is None, "the sleeping rank should still be asleep"


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=SLOW_ESSENTIAL)])
def test_rank_leaving_the_loop_early_is_named(world_size):
    """The last rank's loop ends a step before the others' (it exits cleanly): the others raise
    within 60 s, naming it and the last iteration it recorded, at the default wait budget."""
    with Ranks(["tests/helpers/fault_job.py", "--mode", "leave", "--fail-step", "2"],
               world_size) as ranks:
        results = ranks.wait(range(world_size), DEADLINE_S)
        assert results[world_size - 1].returncode == 0, results[world_size - 1].output
        assert "LEFT" in results[world_size - 1].output
        messages = _assert_survivors_report(results, world_size)
        assert all(_names_last_rank(m, world_size) for m in messages), messages
        assert all("iteration 2: backward finished" in m for m in messages), messages


@pytest.mark.parametrize("mode,world_size,exit_code", [
    ("kill", 2, -9),     # SIGKILL in forward
    ("exit", 3, 7),      # os._exit in backward
    pytest.param("raise", 2, 1, marks=SLOW_ESSENTIAL),  # an exception in backward, uncaught
], ids=["sigkill-forward", "exit-backward", "raise-backward"])
def test_dead_rank_ends_survivors(mode, world_size, exit_code):
    with Ranks(["tests/helpers/fault_job.py", "--mode", mode, "--fail-step", "2"], world_size) as ranks:
        results = ranks.wait(range(world_size), DEADLINE_S)
        assert results[world_size - 1].returncode == exit_code, results[world_size - 1].output
        messages = _assert_survivors_report(results, world_size)
        assert all(_names_last_rank(m, world_size) for m in messages), messages


# ---- a rank that fails before the first all-gather --------------------------------------------------
MEET_ERROR = re.compile(r"CollectiveError: rank (\d+): cannot create the issue thread's process "
                        r"group \(made at the root's first forward\) over ranks \[0, 1\]: "
                        r"rank\(s\) \[1\] did not arrive")


@pytest.mark.parametrize("mode,how", [
    ("kill_before_forward", "(a member's connection broke: it exited or died)"),
    pytest.param("sleep_before_forward", "within 5 s (collective_timeout)",
                 marks=SLOW_ESSENTIAL),
], ids=["dead", "stuck"])
def test_rank_failing_before_the_first_all_gather_is_named(mode, how):
    """The last rank of 2 dies (at once) or blocks (within the collective timeout) after
    fully_shard, before its first forward: the other ends with a CollectiveError naming it, where
    the root's first forward creates the issue thread's group, before any collective. (The group
    used to be made in the first all-gather, where the survivor waited for the dead rank for the
    process group's timeout, 10 min here, whatever the collective timeout; torch's FSDP2, which
    makes no group, fails at once: "Connection closed by peer".)"""
    env = {"FSDP_EXT_COLLECTIVE_TIMEOUT_S": "5"}
    with Ranks(["tests/helpers/fault_job.py", "--mode", mode, "--fail-step", "0"], 2, env) as ranks:
        survivor = ranks.wait([0], DEADLINE_S)[0]
    assert survivor.returncode not in (None, 0), survivor.output[-3000:]
    assert survivor.seconds < 60, (survivor.seconds, survivor.output[-3000:])
    match = MEET_ERROR.search(survivor.output)
    assert match and match.group(1) == "0", survivor.output[-3000:]
    assert how in survivor.output, survivor.output[-3000:]


LATE_MEET = ("cannot create the issue thread's process group (made at the root's first forward) "
             "over ranks [0, 1]: ")
PG_BOUND = "the process group's timeout; collective_timeout not set"


@pytest.mark.slow
@pytest.mark.essential
def test_rank_late_to_the_first_forward_is_waited_for_as_torch_waits():
    """Rank 0 loads alone (sleeps 6 s) before the first forward; the default collective timeout
    (300 s, 2 s here) is not set by the user: the others wait for it as torch's first collective
    would, up to the process group's timeout (600 s), and every rank trains. (They used to raise
    once the default bound had passed.)"""
    args = ["tests/helpers/fault_job.py", "--mode", "late_rank0", "--late-s", "6",
            "--default-timeout-s", "2", "--steps", "2"]
    with Ranks(args, 2) as ranks:
        results = ranks.wait([0, 1], DEADLINE_S)
    for result in results.values():
        assert result.returncode == 0 and "DONE" in result.output, result.output[-3000:]


@pytest.mark.slow
@pytest.mark.essential
def test_rank_later_than_the_process_group_timeout_hears_the_others_gave_up():
    """Rank 0 is later than the process group's timeout (4 s): rank 1 gives up after it, naming
    rank 0 and the 4 s; rank 0, when it arrives, says rank 1 gave up waiting for it (it used to
    say that every member had arrived and a connection broke)."""
    args = ["tests/helpers/fault_job.py", "--mode", "late_rank0", "--late-s", "12",
            "--pg-timeout-s", "4"]
    with Ranks(args, 2) as ranks:
        results = ranks.wait([0, 1], DEADLINE_S)
    waiter, late = results[1], results[0]
    assert waiter.returncode not in (None, 0), waiter.output[-3000:]
    assert (f"CollectiveError: rank 1: {LATE_MEET}rank(s) [0] did not arrive (dead, stuck, or "
            f"running other code) within 4 s ({PG_BOUND}); every member makes it at the same "
            "point; to wait longer, give init_process_group a longer timeout or set "
            "collective_timeout") in waiter.output, waiter.output[-3000:]
    assert late.returncode not in (None, 0), late.output[-3000:]
    assert (f"CollectiveError: rank 0: {LATE_MEET}this rank arrived after the others gave up "
            f"waiting for it (rank 1 waited 4 s: {PG_BOUND})") in late.output, late.output[-3000:]


@pytest.mark.slow
@pytest.mark.essential
def test_one_rank_error_at_the_first_all_gather_ends_every_rank():
    """At world 3 the last rank's subclass hook returns its unpadded rows: that rank raises at
    the first all-gather, naming the parameter, and the others end with a CollectiveError naming
    it (they used to wait in the issue thread's group creation, past 60 s with a collective
    timeout of 20 s)."""
    world_size = 3
    env = {"FSDP_EXT_COLLECTIVE_TIMEOUT_S": "20"}
    with Ranks(["tests/helpers/fault_job.py", "--mode", "unpadded_hook", "--fail-step", "0"],
               world_size, env) as ranks:
        results = ranks.wait(range(world_size), DEADLINE_S)
    padded = results[world_size - 1]
    assert padded.returncode == 1, padded.output[-3000:]
    assert "parameter '3.weight' (HiLo) is sharded unevenly" in padded.output, padded.output
    messages = _assert_survivors_report(results, world_size)
    assert all(_names_last_rank(m, world_size) for m in messages), messages


def late_member_worker(rank: int, world_size: int) -> None:
    """process_groups.meet, the wait before every group the runtime creates, on gloo (a barrier)
    and as on other backends (the store, polled): members that all arrive pass; a member later
    than the bound is named by the others, and raises itself when it arrives instead of waiting
    in the creation for the ones that gave up. Left at its default, the bound is the group's own
    timeout."""
    from fsdp_ext.runtime.comm import collectives as comm, process_groups
    bound = datetime.timedelta(seconds=2)
    get_backend = dist.get_backend
    for backend in ("gloo", "nccl"):
        parent = dist.new_group(list(range(world_size)))
        dist.get_backend = lambda group=None: backend  # (the store path runs on gloo groups too)
        try:
            process_groups.meet(parent, bound, "create a test group")
            if rank == world_size - 1:
                time.sleep(4)
                expected = ("this rank arrived after the others gave up waiting for it (rank 0 "
                            "waited 2 s: collective_timeout)")
            else:
                expected = (f"rank(s) [{world_size - 1}] did not arrive (dead, stuck, or running "
                            "other code) within 2 s (collective_timeout)")
            with pytest.raises(fsdp_ext.CollectiveError, match=re.escape(
                    f"rank {rank}: cannot create a test group: {expected}")):
                process_groups.meet(parent, bound, "create a test group")
        finally:
            dist.get_backend = get_backend
    # The default bound (nobody set one) gives way to the group's own timeout (3 s here).
    parent = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=3))
    if rank == world_size - 1:
        time.sleep(1.5)
    process_groups.meet(parent, comm.DefaultTimeout(seconds=0.5), "create a test group")
    dist.barrier()


@pytest.mark.slow
@pytest.mark.essential
def test_late_member_at_group_creation_is_named_on_both_sides():
    run_distributed(late_member_worker, 2)


def root_timeout_worker(rank: int, world_size: int) -> None:
    """FSDP_EXT_COLLECTIVE_TIMEOUT_S=1 on every rank, and the root's collective_timeout=0, which
    applies to the whole model: the last rank comes 3 s late to its blocks' fully_shard
    (reshard_after_forward=2) and 3 s late to the first forward, and nobody raises. (The blocks'
    post-forward groups used to be made in their own fully_shard, under the 1 s bound.)"""
    from fsdp_ext.runtime.core.registry import unit_of
    os.environ["FSDP_EXT_COLLECTIVE_TIMEOUT_S"] = "1"
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))
    late = rank == world_size - 1
    time.sleep(3 if late else 0)
    for layer in model:
        fsdp_ext.fully_shard(layer, reshard_after_forward=2)
    fsdp_ext.fully_shard(model, collective_timeout=0)
    time.sleep(3 if late else 0)
    for _ in range(2):  # the second step regathers each block from its post-forward group
        model(torch.randn(2, 8)).sum().backward()
    post_forward = unit_of(model[0]).groups.post_forward
    assert dist.get_process_group_ranks(post_forward) == [rank // 2 * 2, rank // 2 * 2 + 1]
    dist.barrier()


@pytest.mark.slow
@pytest.mark.essential
def test_root_collective_timeout_reaches_the_blocks_group_creation():
    run_distributed(root_timeout_worker, 4)


def _reference_losses(steps: int) -> list[float]:
    """The unwrapped model trained in this process on the whole batch: the uninterrupted run."""
    from ..helpers.fault_job import build_model, loss_of, make_batch, make_optimizer
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
    args = ["tests/helpers/fault_job.py", "--steps", str(steps), "--ckpt-dir", directory]
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
