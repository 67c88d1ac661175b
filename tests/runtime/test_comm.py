"""comm.all_gather_into on CPU (one broadcast per rank, in place) against gloo's own all-gather:
several in flight at once and waited out of order (as prefetch leaves them), input in place or
from a separate tensor, fp32 and bf16, over the world and over a subgroup."""
from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_ext.runtime.comm import collectives as comm

from ..helpers.dist import on_world_and_last_two, run_distributed


def _gather_several(group, rank: int, world: int, gen: torch.Generator) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        pending = []
        for i, n in enumerate([1, 7, 1000, 65537]):
            shard = torch.randn(n, generator=gen).to(dtype)
            out = torch.full((n * world,), float("nan"), dtype=dtype)
            source = shard if i % 2 else out.narrow(0, rank * n, n).copy_(shard)
            pending.append((comm.all_gather_into(out, source, group, async_op=True), out, shard))
        for work, out, shard in reversed(pending):
            work.wait()
            ref = torch.empty_like(out)
            dist.all_gather_into_tensor(ref, shard, group=group)
            assert torch.equal(out, ref), (dtype, shard.numel())
    # Blocking, into a 2-D output (the state-dict path gathers whole flat buffers).
    shard = torch.randn(6, generator=gen)
    out = torch.empty(world, 6)
    assert comm.all_gather_into(out, shard, group, async_op=False) is None
    ref = torch.empty(world * 6)
    dist.all_gather_into_tensor(ref, shard, group=group)
    assert torch.equal(out.view(-1), ref)


def check_all_gather(rank: int, world_size: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    # In the subgroup broadcast sources are global ranks, chunks group ranks.
    on_world_and_last_two(_gather_several, rank, world_size, gen)


def test_cpu_all_gather_matches_gloo_three_ranks():
    run_distributed(check_all_gather, 3)
