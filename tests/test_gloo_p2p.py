"""gloo_p2p's all-gather and reduce-scatter against gloo's own collectives, with several of each in
flight at once (as prefetch and pending reduce-scatters leave them) and waited out of order."""
from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_ext import gloo_p2p

from .dist_utils import run_distributed


def check_against_gloo(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(100 + rank)
    for dtype in (torch.float32, torch.bfloat16):
        sizes = [1, 7, 1000, 65537]
        # All-gathers: input in place (this rank's slot) and from a separate tensor.
        outputs, exchanges, references = [], [], []
        for i, n in enumerate(sizes):
            shard = torch.randn(n, generator=gen).to(dtype)
            out = torch.full((n * world_size,), float("nan"), dtype=dtype)
            source = shard if i % 2 else out.narrow(0, rank * n, n).copy_(shard)
            exchanges.append(gloo_p2p.all_gather(out, source, group))
            outputs.append(out)
            ref = torch.empty(n * world_size, dtype=dtype)
            references.append((ref, shard))
        # Reduce-scatters in flight together with them.
        flats = [torch.randn(n * world_size, generator=gen).to(dtype) for n in sizes]
        expected = [f.clone() for f in flats]
        scattered = [gloo_p2p.reduce_scatter_sum(f, n, group) for f, n in zip(flats, sizes)]
        for exchange in reversed(exchanges):
            exchange.wait()
        for (_, exchange) in reversed(scattered):
            exchange.wait()
        for out, (ref, shard) in zip(outputs, references):
            dist.all_gather_into_tensor(ref, shard)
            assert torch.equal(out, ref)
        for (mine, _), full, n in zip(scattered, expected, sizes):
            summed = full.float()
            dist.all_reduce(summed)
            want = summed.narrow(0, rank * n, n)
            tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: rounded after each addition
            torch.testing.assert_close(mine.float(), want, rtol=tol, atol=tol)


def test_p2p_collectives_three_ranks():
    run_distributed(check_against_gloo, 3)
