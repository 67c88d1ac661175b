"""The CPU issue thread (csrc/cpu/issue_thread.cpp): all-gathers queued from the compute thread,
copied in and issued on the thread, against gloo's own all-gather of the same shards; errors that
reach the waiting thread; and training parity with the thread switched off (the default, with it,
is what the rest of the suite runs)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from fsdp_ext import ops
from fsdp_ext import env
from fsdp_ext.runtime.comm import collectives as comm, process_groups

from ..helpers.dist import on_world_and_last_two, run_distributed
from ..helpers.parity import cases_for, run_case

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="needs the compiled extension")


def _queued_gathers_match_gloo(group, rank: int, world: int, gen: torch.Generator) -> None:
    issue_group = process_groups.issue_thread_group(group)
    assert issue_group is not group and process_groups.issue_thread_group(group) is issue_group
    jobs = []
    for n, dtypes in [(1, [torch.float32]), (1000, [torch.float32, torch.bfloat16]),
                      (65537, [torch.bfloat16, torch.float32, torch.float16])]:
        shards = [torch.randn(n, generator=gen) for _ in dtypes]  # fp32, cast into each buffer
        fulls = [torch.full((n * world,), float("nan"), dtype=d) for d in dtypes]
        jobs.append((comm.issue_all_gather(fulls, shards, rank, issue_group, "test", None),
                     fulls, shards))
    for pending, fulls, shards in reversed(jobs):  # several in flight, waited out of order
        pending.wait()
        for full, shard in zip(fulls, shards):
            ref = torch.empty_like(full)
            dist.all_gather_into_tensor(ref, shard.to(full.dtype), group=group)
            assert torch.equal(full, ref), (full.dtype, shard.numel())


def check_issue_thread(rank: int, world_size: int) -> None:
    gen = torch.Generator().manual_seed(10 + rank)
    # In the subgroup the broadcasts' roots are group ranks.
    on_world_and_last_two(_queued_gathers_match_gloo, rank, world_size, gen)
    # No group (a world of one): the copy-in alone.
    full = torch.zeros(8, dtype=torch.bfloat16)
    comm.issue_all_gather([full], [torch.arange(4.0)], 1, None, "copy", None).wait()
    assert full.tolist() == [0, 0, 0, 0, 0, 1, 2, 3]
    # A bad job fails at its wait, names the collective and the problem; later jobs still run.
    bad = comm.issue_all_gather([torch.zeros(8)], [torch.ones(4)], 2, None,
                                "all_gather of unit 'blocks.3'", None)
    with pytest.raises(comm.CollectiveError,
                       match=rf"rank {rank}: all_gather of unit 'blocks.3' failed: .*slot 2"):
        bad.wait()
    _queued_gathers_match_gloo(dist.group.WORLD, rank, world_size, gen)


def test_queued_all_gathers_match_gloo_three_ranks():
    run_distributed(check_issue_thread, 3)


def test_bad_arguments_are_refused_on_the_calling_thread():
    with pytest.raises(RuntimeError, match="2 gathered buffers but 1 sources"):
        comm.issue_all_gather([torch.zeros(4), torch.zeros(4)], [torch.ones(2)], 0, None, "", None)
    with pytest.raises(RuntimeError, match="flat contiguous CPU"):
        comm.issue_all_gather([torch.zeros(2, 4)], [torch.ones(4)], 0, None, "", None)


def _parity_without_the_thread(rank: int, world_size: int) -> None:
    os.environ[env.ISSUE_THREAD] = "0"  # read at each fully_shard (fsdp_ext/env.py)
    for case in cases_for(world_size):
        run_case(case, rank, world_size)
    assert not process_groups._ISSUE_GROUP_CACHE, "the issue thread was used although switched off"


def test_training_parity_with_the_issue_thread_switched_off():
    run_distributed(_parity_without_the_thread, 2)


def _parity_uses_the_thread(rank: int, world_size: int) -> None:
    for case in cases_for(world_size)[:2]:
        run_case(case, rank, world_size)
    assert process_groups._ISSUE_GROUP_CACHE, "the runtime did not issue through the issue thread"


def test_training_issues_all_gathers_on_the_thread_by_default():
    run_distributed(_parity_uses_the_thread, 2)
