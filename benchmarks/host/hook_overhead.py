"""Where the exposed time of bench_overlap's `sleep` rows goes: the compute thread's own work per unit.

Runs bench_overlap's sleep chain (12 units, d x d weights, k sleeps of 2 ms) on --world-size gloo
ranks, plain and sharded at prefetch depth 1, and splits each unit's time on rank 0 into
    pre      from the module call to its forward (the runtime's pre-forward hook: waiting for
             this unit's all-gather, pointing the parameters at it, issuing the next one)
    compute  the forward itself (the sleeps)
    post     from the forward's end to the call's return (the post-forward hook: reshard)
with timestamps from an outer pre-hook, the forward, and an outer post-hook. Then the same hooks
with nothing to gather (each rank sharding over a group of itself, d = 64) after sleeps and in a
tight loop (k = 0), and, after a sleep of --sleep-ms, how long a Python no-op and a wait on an
all-gather that has long finished take: the price of running cold. Last, the pieces of the hooks,
timed by wrapping the runtime's functions on a fresh sharded chain (each wrapper adds its own
call, and an outer piece includes the wrappers of the pieces inside it).

    python -m benchmarks.host.hook_overhead
    python -m benchmarks.host.hook_overhead --d 1024 --k 4
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fsdp_ext import exit_without_finalization

from ..common import init_rank, launch, machine, machine_line
from ..overlap import chain as overlap_chain

UNITS = 12
SLEEP_S = 0.002


def _phases(chain, x, reps: int) -> dict[str, list[float]]:
    """Per-unit pre/compute/post seconds (unit index i at position i of every rep's run)."""
    stamps: list[float] = []
    clock = time.perf_counter
    forward = overlap_chain.MatmulUnit.forward

    def timed_forward(self, inp):
        stamps.append(clock())
        out = forward(self, inp)
        stamps.append(clock())
        return out

    handles = []
    for unit in chain:
        handles.append(unit.register_forward_pre_hook(lambda *_: stamps.append(clock()),
                                                      prepend=True))
        handles.append(unit.register_forward_hook(lambda *_: stamps.append(clock())))
    overlap_chain.MatmulUnit.forward = timed_forward
    out = {"pre": [], "compute": [], "post": [], "forward": []}
    try:
        for _ in range(reps):
            stamps.clear()
            dist.barrier()
            t0 = clock()
            chain(x)
            out["forward"].append(clock() - t0)
            for i in range(0, len(stamps), 4):
                begin, f0, f1, end = stamps[i:i + 4]
                out["pre"].append(f0 - begin)
                out["compute"].append(f1 - f0)
                out["post"].append(end - f1)
    finally:
        overlap_chain.MatmulUnit.forward = forward
        for h in handles:
            h.remove()
    return out


def _pieces(d: int, k: int, x: torch.Tensor, reps: int) -> dict[str, list[float]]:
    """Seconds per call of each piece of the pre/post-forward hooks, on rank 0's sharded chain."""
    from fsdp_ext import _C
    from fsdp_ext.runtime.comm import collectives as comm
    from fsdp_ext.runtime.core import storage_cache
    from fsdp_ext.runtime.unit.schedule import Schedule
    from fsdp_ext.runtime.unit.unit import Unit
    from fsdp_ext.runtime.unit.params import UnitParams
    pieces = [(Unit, "_pre_forward", "pre-forward hook"),
              (comm.Pending, "wait", "  wait for this unit's all-gather"),
              (UnitParams, "install_unsharded", "  point the parameters at the gathered views"),
              (Schedule, "prefetch_forward", "  issue the next unit's all-gather"),
              (storage_cache, "fill", "    refill one gathered buffer"),
              (_C, "issue_all_gather", "    submit to the issue thread (C++)"),
              (Unit, "_post_forward", "post-forward hook"),
              (UnitParams, "install_sharded", "  point the parameters back at the shards")]
    times: dict[str, list[float]] = {label: [] for _, _, label in pieces}
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in pieces]
    clock = time.perf_counter

    def timed(fn, out):
        def call(*a, **kw):
            t0 = clock()
            result = fn(*a, **kw)
            out.append(clock() - t0)
            return result
        return call

    for (owner, name, fn), (_, _, label) in zip(originals, pieces):
        setattr(owner, name, timed(fn, times[label]))
    try:  # the hooks are bound when fully_shard runs: shard after wrapping
        chain = overlap_chain.shard_chain(d, k, UNITS, 1, SLEEP_S)
        chain(x)
        chain(x)
        for samples in times.values():
            samples.clear()
        for _ in range(reps):
            dist.barrier()
            chain(x)
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return times


def _cold_costs(sleep_s: float, reps: int) -> dict[str, float]:
    """After sleeping: a Python no-op call, and the wait on a long-finished unit all-gather."""
    from fsdp_ext import env
    from fsdp_ext.runtime.comm import collectives as comm, process_groups
    rank, world = dist.get_rank(), dist.get_world_size()
    group = (process_groups.issue_thread_group(dist.group.WORLD)
             if comm.Streams(torch.device("cpu"), None, env.read().issue_thread).issue_thread
             else None)
    n = 1 << 18
    full, shard = torch.empty(n * world), torch.randn(n)
    noop, wait = [], []
    for _ in range(reps):
        dist.barrier()
        time.sleep(sleep_s)
        t0 = time.perf_counter()
        len(())
        noop.append(time.perf_counter() - t0)
        if group is not None:
            pending = comm.issue_all_gather([full], [shard], rank, group, "probe", None)
        else:
            pending = comm.Pending(works=[comm.all_gather_into(full, full.narrow(0, rank * n, n),
                                                               None, True)])
        time.sleep(sleep_s)
        t0 = time.perf_counter()
        pending.wait()
        wait.append(time.perf_counter() - t0)
    return dict(noop_us=1e6 * statistics.median(noop), wait_us=1e6 * statistics.median(wait))


def worker(rank: int, world_size: int, port: int, args) -> None:
    init_rank(rank, world_size, port, timeout_s=300)
    from fsdp_ext.runtime.comm import process_groups
    alone = process_groups.subgroup([rank])  # every hook runs, nothing to gather from peers
    configs = [(f"d={args.d}, k={args.k}, world {world_size}", args.d, args.k, None),
               (f"d=64, k={args.k}, one-rank group", 64, args.k, alone),
               ("d=64, k=0, one-rank group (no sleep)", 64, 0, alone)]
    results = {}
    with torch.no_grad():
        for label, d, k, group in configs:
            x = torch.randn(32, d)
            plain = overlap_chain.build_chain(d, k, UNITS, SLEEP_S)
            sharded = overlap_chain.shard_chain(d, k, UNITS, 1, SLEEP_S, process_group=group)
            for chain in (plain, sharded, plain, sharded):  # warm-up; records the order
                chain(x)
            results[label] = {name: _phases(chain, x, args.reps)
                              for name, chain in (("plain", plain), ("sharded", sharded))}
        cold = _cold_costs(args.sleep_ms / 1e3, args.reps)
        pieces = _pieces(args.d, args.k, torch.randn(32, args.d), args.reps)
    if rank == 0:
        report(results, cold, pieces, args)
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalization()


def report(results: dict, cold: dict, pieces: dict, args) -> None:
    ms = lambda v: f"{1e3 * statistics.median(v):.3f}"  # noqa: E731
    print(f"hook_overhead: d={args.d}, {UNITS} units, world {args.world_size}, "
          f"medians of {args.reps} forwards; {machine_line(machine())}")
    print("| run | chain | forward (ms) | unit 0 pre (ms) | later units: pre (ms) | post (ms) |")
    print("|---|---|---|---|---|---|")
    for label, runs in results.items():
        for name, p in runs.items():
            first = p["pre"][0::UNITS]
            later = [v for i, v in enumerate(p["pre"]) if i % UNITS]
            print(f"| {label} | {name} | {ms(p['forward'])} | {ms(first)} | {ms(later)} | "
                  f"{ms(p['post'])} |")
    print(f"after a {args.sleep_ms:g} ms sleep: a Python no-op call {cold['noop_us']:.1f} us, "
          f"the wait on a finished all-gather {cold['wait_us']:.1f} us")
    print(f"pieces of the hooks (d={args.d}, k={args.k}, world {args.world_size}, rank 0), "
          "median per call:")
    for label, samples in pieces.items():
        print(f"{label:48s} {1e6 * statistics.median(samples):7.1f} us  ({len(samples)} calls)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--d", type=int, default=1024, help="unit: a d x d fp32 weight")
    p.add_argument("--k", type=int, default=4, help="sleeps of 2 ms per unit")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sleep-ms", type=float, default=5.0)
    args = p.parse_args()
    launch(worker, args.world_size, args)


if __name__ == "__main__":
    main()
