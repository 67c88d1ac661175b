"""Per-step wall time, CPU time and minor page faults of each rank, for one framework.

In a default process (no allocator settings changed, unlike bench_step's memory phase), so it
shows what fresh memory costs a step: every block the allocator maps anew is faulted in and zeroed
page by page.

    python benchmarks/page_faults.py --large --world-size 4 --steps 2
    python benchmarks/page_faults.py --framework ddp --large --world-size 4 --steps 2
"""
from __future__ import annotations

import argparse
import datetime
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from fsdp_ext import exit_without_finalization  # noqa: E402
from launch import free_port  # noqa: E402
from step_frameworks import DEFAULT, FRAMEWORKS, LARGE, build_model, make_batch, wrap  # noqa: E402


def worker(rank: int, world_size: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=900))
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
    mp.spawn(worker, args=(args.world_size, free_port(), args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
