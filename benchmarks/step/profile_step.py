"""Profile one framework's training step from bench_step.py: torch.profiler on every rank.

Prints, per rank, the operators with the most self CPU time and the fsdp_ext trace events of one
step (collective issue/wait, unit forward/backward); writes a Chrome trace per rank to --out.

    python -m benchmarks.step.profile_step --framework fsdp_ext --out /tmp/prof
    py-spy record --subprocesses --native --format raw -o /tmp/spy.txt -- \
        python -m benchmarks.step.profile_step --plain --steps 6
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..common import init_rank, launch
from .frameworks import DEFAULT, FRAMEWORKS, LARGE, build_model, make_batch, wrap


def worker(rank: int, world_size: int, port: int, args) -> None:
    from fsdp_ext.runtime.core.trace import recording
    init_rank(rank, world_size, port, threads=args.threads, timeout_s=600)
    cfg = LARGE if args.large else DEFAULT
    device = torch.device("cpu")
    options = dict(forward_prefetch=args.prefetch, backward_prefetch=args.prefetch)
    model = wrap(args.framework, build_model(cfg, device), device, options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = make_batch(cfg, rank, device)

    def step():
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(2):
        step()
    dist.barrier()
    if args.plain:  # no torch.profiler: for an outside sampler such as py-spy
        for _ in range(args.steps):
            dist.barrier()
            step()
        dist.destroy_process_group()
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with recording() as events:
            for _ in range(args.steps):
                dist.barrier()
                with torch.profiler.record_function("bench::step"):
                    step()
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.out, f"{args.framework}_rank{rank}.json"))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    t0 = events[0].t if events else 0.0
    timeline = "\n".join(f"{e.t - t0:8.3f} {e.kind:28s} {e.unit}" for e in events)
    for r in range(world_size):
        if r == rank:
            print(f"===== rank {rank} =====\n{table}", flush=True)
            if args.events:
                print(timeline, flush=True)
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--framework", default="fsdp_ext", choices=FRAMEWORKS)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--large", action="store_true")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--events", action="store_true", help="print the fsdp_ext trace events")
    p.add_argument("--plain", action="store_true",
                   help="just run the steps (for py-spy record --subprocesses --native)")
    p.add_argument("--out", default="/tmp/fsdp_ext_profile")
    args = p.parse_args()
    launch(worker, args.world_size, args)


if __name__ == "__main__":
    main()
