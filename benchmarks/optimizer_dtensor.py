"""AdamW on fully_shard's DTensor parameters against AdamW on the same local tensors as plain ones.

torch FSDP2 users report DTensor dispatch costing up to a third of a step in AdamW (pytorch#134191):
every optimizer op on a DTensor goes through sharding propagation before it reaches the local
tensor. This measures that cost on the step benchmark's model (benchmarks/step_frameworks.py,
DEFAULT), world 2, gloo CPU, one thread per rank: two AdamW instances with the same settings, one
over the model's DTensor parameters (with their DTensor gradients), one over plain tensors of the
same local shapes and values, stepped alternately; per implementation (foreach, single-tensor,
fused) the median step time of each, the overhead in ms and as a share of a training step of
`--step-s` seconds (bench_step.py's fsdp_ext median on this machine).

    PYTHONPATH=. python benchmarks/optimizer_dtensor.py [--steps 15] [--step-s 1.2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from fsdp_ext import exit_without_finalization  # noqa: E402
from launch import free_port  # noqa: E402
from step_frameworks import DEFAULT, build_model, make_batch  # noqa: E402

KINDS = {"foreach": dict(foreach=True), "single-tensor": dict(foreach=False),
         "fused": dict(fused=True)}


def _worker(rank: int, world: int, port: int, steps: int, step_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
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
    mp.spawn(_worker, args=(2, free_port(), args.steps, args.step_s), nprocs=2, join=True)


if __name__ == "__main__":
    main()
