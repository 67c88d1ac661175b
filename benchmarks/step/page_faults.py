"""Per-step wall time, CPU time and minor page faults of each rank, for one framework.

In a default process (no allocator settings changed, unlike bench_step's memory phase), so it
shows what fresh memory costs a step: every block the allocator maps anew is faulted in and zeroed
page by page.

    python -m benchmarks.step.page_faults --large --world-size 4 --steps 2
    python -m benchmarks.step.page_faults --framework ddp --large --world-size 4 --steps 2
"""
from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_ext import exit_without_finalization

from ..common import init_rank, launch
from .frameworks import DEFAULT, FRAMEWORKS, LARGE, build_model, make_batch, wrap


def worker(rank: int, world_size: int, port: int, args) -> None:
    init_rank(rank, world_size, port, timeout_s=900)
    cfg = LARGE if args.large else DEFAULT
    device = torch.device("cpu")
    model = wrap(args.framework, build_model(cfg, device), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = make_batch(cfg, rank, device)

    def step():
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: lazy initialisation, optimizer state
    for i in range(args.steps):
        dist.barrier()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu, wall = time.process_time(), time.perf_counter()
        step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        row = torch.tensor([wall, cpu, faults], dtype=torch.float64)
        rows = [torch.zeros(3, dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(rows, row)
        if rank == 0:
            print(f"{args.framework} step {i}: " + "; ".join(
                f"rank {r}: {w:.2f} s wall, {c:.2f} s CPU, {int(f)} minor faults"
                for r, (w, c, f) in enumerate(t.tolist() for t in rows)), flush=True)
    dist.destroy_process_group()
    exit_without_finalization()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--framework", default="fsdp_ext", choices=FRAMEWORKS)
    p.add_argument("--large", action="store_true", help="16 blocks of d_model 1024 (201.6M params)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    launch(worker, args.world_size, args)


if __name__ == "__main__":
    main()
