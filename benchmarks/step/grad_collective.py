"""The gradient reduction on gloo, two ways, side by side: fsdp_ext's (an all-reduce in place of
the packed [W * S] buffer, each rank keeping its region: runtime/comm/collectives.py) and torch's FSDP2's
(`reduce_scatter_tensor` of the same buffer into an [S] output). Per world size and buffer size:
the median time per call over `--iters` calls (after a warm-up), the bytes that crossed the
loopback interface per call and rank (/proc/net/dev, every rank's traffic, divided by W), and
whether the two leave each rank bit-identical values (the summation order).

    .venv/bin/python -m benchmarks.step.grad_collective
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ..common import (RESULTS, command, init_rank, launch, machine, machine_line, markdown_table,
                      write_results)

SIZES = (1 << 20, 1 << 24)  # fp32 elements per rank's region (4 MiB, 64 MiB)


def loopback_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, data = line.partition(":")
            if name.strip() == "lo":
                return int(data.split()[8])  # transmitted bytes
    return 0


def worker(rank: int, world: int, port: int, iters: int, out: list) -> None:
    init_rank(rank, world, port)
    rows = []
    for size in SIZES:
        g = torch.Generator().manual_seed(rank)
        source = torch.randn(world * size, generator=g)
        ways = {
            "all_reduce in place": lambda: dist.all_reduce(flat),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(output, flat),
        }
        results = {}
        for name, call in ways.items():
            times, sent = [], []
            for i in range(iters + 2):
                flat = source.clone()
                output = torch.empty(size)
                dist.barrier()
                before = loopback_bytes()
                start = time.perf_counter()
                call()
                elapsed = time.perf_counter() - start
                dist.barrier()
                after = loopback_bytes()
                if i >= 2:
                    times.append(elapsed)
                    sent.append((after - before) / world)
            mine = (flat.narrow(0, rank * size, size) if name.startswith("all_reduce")
                    else output)
            results[name] = (statistics.median(times), statistics.median(sent), mine.clone())
        (t_ar, b_ar, v_ar), (t_rs, b_rs, v_rs) = results.values()
        same = torch.tensor(int(torch.equal(v_ar, v_rs)))
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        rows.append([world, f"{4 * size / 2**20:.0f} MiB", f"{1e3 * t_ar:.1f}",
                     f"{1e3 * t_rs:.1f}", f"{t_rs / t_ar:.2f}", f"{b_ar / 2**20:.1f}",
                     f"{b_rs / 2**20:.1f}", "yes" if same.item() else "no"])
    if rank == 0:
        out.extend(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    import torch.multiprocessing as mp
    rows = []
    for world in args.worlds:
        shared = mp.Manager().list()
        launch(worker, world, args.iters, shared)
        rows.extend(shared)
    m = machine()
    text = "\n".join([
        "# Gradient reduction on gloo: in-place all-reduce vs reduce_scatter_tensor", "",
        f"Machine: {machine_line(m)}.", f"Command: `{command('benchmarks.step.grad_collective')}`",
        "", markdown_table(["world", "region per rank", "all-reduce ms", "reduce_scatter ms",
                            "reduce_scatter / all-reduce", "all-reduce MiB sent per rank",
                            "reduce_scatter MiB sent per rank", "bit-identical"], rows), ""])
    print(text)
    write_results(RESULTS, "grad_collective", text, {"machine": m, "rows": [list(r) for r in rows]})


if __name__ == "__main__":
    main()
