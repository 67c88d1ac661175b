"""AdamW on fully_shard's DTensor parameters against AdamW on the same local tensors as plain ones.

torch FSDP2 users report DTensor dispatch costing up to a third of a step in AdamW (pytorch#134191):
every optimizer op on a DTensor goes through sharding propagation before it reaches the local
tensor. This measures that cost on the step benchmark's model (benchmarks/step/frameworks.py,
DEFAULT), world 2, gloo CPU, one thread per rank: two AdamW instances with the same settings, one
over the model's DTensor parameters (with their DTensor gradients), one over plain tensors of the
same local shapes and values, stepped alternately; per implementation (foreach, single-tensor,
fused) the median step time of each, the overhead in ms and as a share of a training step of
`--step-s` seconds (bench_step.py's fsdp_ext median on this machine).

    python -m benchmarks.step.optimizer_dtensor [--steps 15] [--step-s 1.2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fsdp_ext import exit_without_finalization

from ..common import init_rank, launch
from .frameworks import DEFAULT, build_model, make_batch

KINDS = {"foreach": dict(foreach=True), "single-tensor": dict(foreach=False),
         "fused": dict(fused=True)}


def _worker(rank: int, world: int, port: int, steps: int, step_s: float) -> None:
    init_rank(rank, world, port)
    import fsdp_ext
    model = build_model(DEFAULT, torch.device("cpu"))
    for layer in model.layers:
        fsdp_ext.fully_shard(layer)
    fsdp_ext.fully_shard(model)
    x, y = make_batch(DEFAULT, rank, torch.device("cpu"))
    ((model(x) - y) ** 2).mean().backward()
    dtensors = list(model.parameters())
    plain = [torch.nn.Parameter(p.to_local().detach().clone()) for p in dtensors]
    for p, q in zip(plain, dtensors):
        p.grad = q.grad.to_local().detach().clone()
    rows = []
    for kind, options in KINDS.items():
        opts = {"DTensor": torch.optim.AdamW(dtensors, lr=1e-6, **options),
                "plain": torch.optim.AdamW(plain, lr=1e-6, **options)}
        times = {name: [] for name in opts}
        for i in range(steps + 2):
            for name in (("DTensor", "plain") if i % 2 else ("plain", "DTensor")):
                start = time.perf_counter()
                opts[name].step()
                if i >= 2:  # the first steps create the state
                    times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) for name, t in times.items()}
        rows.append((kind, medians["DTensor"], medians["plain"]))
    if rank == 0:
        print(f"AdamW over {len(dtensors)} parameters ({sum(p.to_local().numel() for p in dtensors):,} "
              f"local elements per rank), world {world}, median of {steps} steps each\n")
        print("| AdamW | DTensor parameters (ms) | plain tensors (ms) | overhead (ms) | "
              f"of a {step_s:g} s step |")
        print("|---|---|---|---|---|")
        for kind, on_dtensor, on_plain in rows:
            extra = on_dtensor - on_plain
            print(f"| {kind} | {on_dtensor * 1e3:.1f} | {on_plain * 1e3:.1f} | {extra * 1e3:+.1f} | "
                  f"{extra / step_s * 100:+.1f}% |")
    dist.destroy_process_group()
    exit_without_finalization()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--step-s", type=float, default=1.2,
                        help="training step time to relate the overhead to")
    args = parser.parse_args()
    launch(_worker, 2, args.steps, args.step_s)


if __name__ == "__main__":
    main()
