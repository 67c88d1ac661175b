"""The host time each unit costs a training step, fsdp_ext beside PyTorch FSDP2.

A chain of --units tiny units (a d x d weight, one matmul each: compute and bytes are negligible)
trained with forward + backward, and run forward under no_grad:
    plain            the unwrapped chain (no communication)
    fsdp_ext         fsdp_ext.fully_shard per unit, then the root (defaults: prefetch depth 1; on
                     CPU the all-gathers go through the issue thread)
    fsdp_ext inline  the same with FSDP_EXT_ISSUE_THREAD=0: the compute thread issues them itself,
                     as on CUDA (where side streams take the issue thread's place)
    fsdp2            torch.distributed.fsdp.fully_shard per unit, then the root (defaults)
Interleaved repetition by repetition; each is the slowest rank's time, median over reps, divided
by the number of units. With the default single rank no peer is waited for, so the time is the
framework's own Python and C++ around each unit (and, with the issue thread, the hand-offs to
it): the regime of small units on an accelerator, where the host must keep ahead of the kernels.
With more ranks it adds the latency of tiny collectives over gloo.

    python -m benchmarks.host.host_overhead
    python -m benchmarks.host.host_overhead --world-size 2 --units 96
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from fsdp_ext import exit_without_finalization
from fsdp_ext import env

from ..common import (RESULTS, command, init_rank, launch, machine, machine_line, markdown_table,
                      write_results)
from ..overlap.chain import build_chain, shard_chain, shard_chain_fsdp2, slowest_rank_time

FRAMEWORKS = ("plain", "fsdp_ext", "fsdp_ext inline", "fsdp2")


def _chain(name: str, d: int, units: int, x: torch.Tensor):
    if name == "plain":
        return build_chain(d, 1, units)
    if name == "fsdp2":
        return shard_chain_fsdp2(d, 1, units, 0, 0.0)
    # The setting is read at each fully_shard (fsdp_ext/env.py).
    previous = os.environ.get(env.ISSUE_THREAD)
    os.environ[env.ISSUE_THREAD] = "0" if name == "fsdp_ext inline" else "1"
    try:
        chain = shard_chain(d, 1, units, 1, 0.0)
        with torch.no_grad():
            chain(x)
    finally:
        if previous is None:
            del os.environ[env.ISSUE_THREAD]
        else:
            os.environ[env.ISSUE_THREAD] = previous
    return chain


def worker(rank: int, world_size: int, port: int, args) -> None:
    init_rank(rank, world_size, port, timeout_s=300)
    x = torch.randn(4, args.d, requires_grad=True)
    chains = {name: _chain(name, args.d, args.units, x) for name in FRAMEWORKS}

    def train(chain):
        chain(x).sum().backward()

    def no_grad(chain):
        with torch.no_grad():
            chain(x)

    runs = {(name, mode): (fn, chain) for name, chain in chains.items()
            for mode, fn in (("train", train), ("no_grad", no_grad))}
    for fn, chain in runs.values():  # warm-up; the first forward also records the order
        for _ in range(3):
            fn(chain)
    samples: dict = {key: [] for key in runs}
    keys = list(runs)
    for i in range(args.reps):
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            fn, chain = runs[key]
            samples[key].append(slowest_rank_time(lambda: fn(chain)))
    if rank == 0:
        report({f"{name}/{mode}": statistics.median(v) / args.units
                for (name, mode), v in samples.items()}, args)
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalization()


def report(per_unit: dict, args) -> None:
    m = machine()
    cmd = command(__spec__.name)
    rows = []
    for mode, what in (("train", "forward + backward"), ("no_grad", "forward under no_grad")):
        us = {name: 1e6 * per_unit[f"{name}/{mode}"] for name in FRAMEWORKS}
        above = lambda name: (us[name] - us["plain"]) / (us["fsdp2"] - us["plain"])  # noqa: E731
        rows.append([what, *[f"{us[name]:.1f}" for name in FRAMEWORKS],
                     f"{above('fsdp_ext'):.2f}", f"{above('fsdp_ext inline'):.2f}"])
    table = markdown_table(["per unit", *[f"{name} (us)" for name in FRAMEWORKS],
                            "fsdp_ext ÷ fsdp2, above plain", "inline ÷ fsdp2, above plain"],
                           rows)
    text = "\n".join([
        f"### Host time per unit: {args.units} units of {args.d} x {args.d}, world size "
        f"{args.world_size}, gloo CPU, median of {args.reps}", "", f"`{cmd}`", "",
        f"Machine: {machine_line(m)}", "", table, ""])
    print(text)
    write_results(args.out, f"host_overhead_w{args.world_size}", text,
                  dict(command=cmd, machine=m, args=vars(args), seconds_per_unit=per_unit))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--units", type=int, default=48)
    p.add_argument("--d", type=int, default=64, help="unit: a d x d fp32 weight")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()
    launch(worker, args.world_size, args)


if __name__ == "__main__":
    main()
