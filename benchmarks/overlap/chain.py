"""The overlap benchmark's model: a chain of units of one d x d weight each, plain, sharded by
fsdp_ext or by PyTorch FSDP2, and the slowest rank's time of a run of it. The host benchmarks time
the runtime's hooks on the same chain."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn


class MatmulUnit(nn.Module):
    """k matmuls with the unit's weight; or, with sleep_s > 0, k sleeps: compute that leaves the
    host's cores idle, as an accelerator's kernels do."""

    def __init__(self, d: int, k: int, sleep_s: float = 0.0):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)  # norm-preserving on average
        self.k = k
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.k * self.sleep_s)
            return x + self.w[0, 0]  # still reads the gathered weight
        for _ in range(self.k):
            x = x @ self.w
        return x


def build_chain(d: int, k: int, units: int, sleep_s: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(MatmulUnit(d, k, sleep_s) for _ in range(units)))


def shard_chain(d: int, k: int, units: int, depth: int, sleep_s: float,
                process_group=None) -> nn.Sequential:
    import fsdp_ext
    chain = build_chain(d, k, units, sleep_s)
    opts = dict(forward_prefetch=depth, backward_prefetch=depth, process_group=process_group)
    for unit in chain:
        fsdp_ext.fully_shard(unit, **opts)
    return fsdp_ext.fully_shard(chain, **opts)


def shard_chain_fsdp2(d: int, k: int, units: int, depth: int, sleep_s: float,
                      async_unshard: bool = False) -> nn.Sequential:
    """The same chain under PyTorch FSDP2, each unit prefetching the next `depth` units' all-gathers
    in forward (FSDP2 prefetches in forward only when told which modules to)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    chain = build_chain(d, k, units, sleep_s)
    for unit in chain:
        fully_shard(unit, mesh=mesh)
    fully_shard(chain, mesh=mesh)
    if async_unshard:
        chain._set_unshard_async_op(True)
    if depth:
        for i, unit in enumerate(chain):
            unit.set_modules_to_forward_prefetch(list(chain)[i + 1:i + 1 + depth])
    return chain


def slowest_rank_time(fn) -> float:
    """Slowest rank's wall time of fn() started together after a barrier."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
