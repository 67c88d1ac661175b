"""Communication/compute overlap microbenchmark: how much of the all-gather time fsdp_ext hides.

A chain of --units units, each one d x d fp32 weight (the unit size) and a forward of k matmuls of a
[batch, d] activation with it (the compute intensity), or k sleeps of --sleep-ms ("sleep": compute
that leaves the cores idle, as work on an accelerator does). For every (kind, d, k), on
--world-size gloo ranks:
    compute   the unsharded chain's forward (plain module, no communication)
    comm      fsdp_ext's all-gather of every unit alone (FSDPModule.unshard() + reshard())
    depth p   the fsdp_ext-sharded chain's forward with forward prefetch depth p = 0, 1, 2
and the baseline, PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard` on the same units):
    fsdp2 comm     its all-gather of every unit alone (FSDPModule.unshard() + reshard())
    fsdp2 depth p  its forward, p = 0 (its default: no forward prefetch) and p = 1 (each unit
                   prefetching the next through set_modules_to_forward_prefetch)
    fsdp2 depth 1 async  the same with FSDPModule._set_unshard_async_op(True): FSDP2's all-gathers
                   are otherwise issued with async_op=False, which on CPU (no side stream to run
                   them on) makes even a prefetch wait for its all-gather on the spot
Forward only, under no_grad, so the all-gather is the only collective. The nine measurements of a
(d, k) are interleaved repetition by repetition; each is the slowest rank's time, median over reps.
    exposed communication = (t_depth - t_compute) / t_comm     (each framework's own t_comm)
0 means fully hidden, 1 means fully serial (depth 0 should read about 1).

On a 2-core machine with 2 ranks, gloo's threads (which copy every byte through the loopback TCP
stack) compete with the matmul threads for the same cores, so communication cannot hide behind
matmuls there, however early it is issued: the matmul rows measure that contention, the sleep rows
the schedule itself.

    python -m benchmarks.overlap.bench_overlap
    python -m benchmarks.overlap.bench_overlap --sizes 1024 --matmuls 1 4 --reps 3   # quick
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

from fsdp_ext import exit_without_finalization

from ..common import (RESULTS, command, init_rank, launch, machine, machine_line, markdown_table,
                      write_results)
from .chain import build_chain, shard_chain, shard_chain_fsdp2, slowest_rank_time

DEPTHS = (0, 1, 2)
FSDP2_VARIANTS = {"depth0": (0, False), "depth1": (1, False), "depth1_async": (1, True)}
TARGET_EXPOSED = 0.15  # issue: <= 15% exposed with depth 1 when compute per unit >= comm per unit


def measure(kind: str, d: int, k: int, args) -> dict:
    x = torch.randn(args.batch, d, generator=torch.Generator().manual_seed(dist.get_rank()))
    sleep_s = args.sleep_ms / 1e3 if kind == "sleep" else 0.0
    plain = build_chain(d, k, args.units, sleep_s)
    sharded = {p: shard_chain(d, k, args.units, p, sleep_s) for p in DEPTHS}
    fsdp2 = {name: shard_chain_fsdp2(d, k, args.units, depth, sleep_s, async_unshard)
             for name, (depth, async_unshard) in FSDP2_VARIANTS.items()}

    def gather_only(chain):
        for unit in chain:
            unit.unshard()
            unit.reshard()

    runs = {"compute": lambda: plain(x), "comm": lambda: gather_only(sharded[1])}
    runs.update({f"depth{p}": (lambda p=p: sharded[p](x)) for p in DEPTHS})
    runs["fsdp2_comm"] = lambda: gather_only(fsdp2["depth0"])
    runs.update({f"fsdp2_{name}": (lambda name=name: fsdp2[name](x)) for name in FSDP2_VARIANTS})
    samples: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad():
        # Warm-up; the first sharded forward also records the order (and makes the root), so the
        # sharded chains go before the all-gather-only run.
        first = [f"depth{p}" for p in DEPTHS] + [f"fsdp2_{name}" for name in FSDP2_VARIANTS]
        for name in first + ["compute", "comm", "fsdp2_comm"]:
            runs[name]()
            runs[name]()
        for i in range(args.reps):
            names = list(runs)
            names = names[i % len(names):] + names[:i % len(names)]
            for name in names:
                samples[name].append(slowest_rank_time(runs[name]))
    med = {name: statistics.median(v) for name, v in samples.items()}
    row = dict(kind=kind, d=d, matmuls=k, unit_mb=d * d * 4 / 2**20, units=args.units,
               compute_per_unit_ms=1e3 * med["compute"] / args.units,
               comm_per_unit_ms=1e3 * med["comm"] / args.units, samples=samples)
    row["compute_over_comm"] = med["compute"] / med["comm"]
    for p in DEPTHS:
        row[f"exposed_depth{p}"] = (med[f"depth{p}"] - med["compute"]) / med["comm"]
    row["fsdp2_comm_per_unit_ms"] = 1e3 * med["fsdp2_comm"] / args.units
    for name in FSDP2_VARIANTS:
        row[f"fsdp2_exposed_{name}"] = (med[f"fsdp2_{name}"] - med["compute"]) / med["fsdp2_comm"]
    # Against FSDP2's faster depth-1 forward of the two.
    row["forward_ratio_depth1"] = med["depth1"] / min(med["fsdp2_depth1"],
                                                      med["fsdp2_depth1_async"])
    return row


def worker(rank: int, world_size: int, port: int, args, path: str) -> None:
    init_rank(rank, world_size, port, threads=args.threads, timeout_s=600)
    rows = []
    for kind in args.kinds:
        for d in args.sizes:
            for k in args.matmuls:
                rows.append(measure(kind, d, k, args))
                r = rows[-1]
                if rank == 0:
                    print(f"{kind} d={d} k={k}: compute/comm {r['compute_over_comm']:.2f}, exposed "
                          + " ".join(f"{r[f'exposed_depth{p}']:.2f}" for p in DEPTHS), flush=True)
    if rank == 0:
        torch.save(rows, path)
    dist.destroy_process_group()
    exit_without_finalization()


def report(rows: list[dict], args, argv: list[str]) -> None:
    m = machine()
    cmd = command(__spec__.name, argv)
    header = ["compute", "unit (MB)", "k/unit", "compute/unit (ms)", "all-gather/unit (ms)",
              "compute ÷ comm", *[f"exposed, depth {p}" for p in DEPTHS],
              "FSDP2 all-gather/unit (ms)", "FSDP2 exposed, depth 0", "FSDP2 exposed, depth 1",
              "FSDP2 exposed, depth 1, async unshard", "forward ÷ FSDP2's faster, depth 1"]
    table = markdown_table(header, [
        [r["kind"], f"{r['unit_mb']:.0f}", r["matmuls"], f"{r['compute_per_unit_ms']:.2f}",
         f"{r['comm_per_unit_ms']:.2f}", f"{r['compute_over_comm']:.2f}",
         *[f"{100 * r[f'exposed_depth{p}']:.0f}%" for p in DEPTHS],
         f"{r['fsdp2_comm_per_unit_ms']:.2f}",
         *[f"{100 * r[f'fsdp2_exposed_{name}']:.0f}%" for name in FSDP2_VARIANTS],
         f"{r['forward_ratio_depth1']:.2f}"] for r in rows])
    verdicts, worst = [], {}
    for kind in args.kinds:
        eligible = [r for r in rows if r["kind"] == kind and r["compute_over_comm"] >= 1.0]
        worst[kind] = max((r["exposed_depth1"] for r in eligible), default=None)
        w = worst[kind]
        verdicts.append(
            f"{kind}: no configuration had compute >= comm" if w is None else
            f"{kind}: worst exposed fraction at depth 1 where compute >= comm: {100 * w:.0f}% "
            f"(target <= {100 * TARGET_EXPOSED:.0f}%: "
            f"{'met' if w <= TARGET_EXPOSED else 'missed'}); FSDP2 at depth 1 on the same "
            f"rows: {100 * max(r['fsdp2_exposed_depth1'] for r in eligible):.0f}%, with async "
            f"unshard {100 * max(r['fsdp2_exposed_depth1_async'] for r in eligible):.0f}%")
        ratios = [r["forward_ratio_depth1"] for r in rows if r["kind"] == kind]
        verdicts.append(f"{kind}: forward time at depth 1, fsdp_ext ÷ FSDP2's faster: median "
                        f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")
    text = "\n".join([
        f"### Overlap: {args.units} units of k matmuls ([{args.batch}, d] x [d, d], fp32), "
        f"world size {args.world_size}, gloo CPU, {args.threads} thread(s)/rank, median of "
        f"{args.reps}", "", f"`{cmd}`", "", f"Machine: {machine_line(m)}", "", table, "",
        *[f"- {v}" for v in verdicts], ""])
    print(text)
    write_results(args.out, "overlap", text,
                  dict(command=cmd, machine=m, args=vars(args), rows=rows, worst_depth1=worst,
                       target=TARGET_EXPOSED))
    chart(rows, os.path.join(args.out, "overlap.png"), machine_line(m))


def chart(rows: list[dict], path: str, subtitle: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for kind, fill in (("matmul", True), ("sleep", False)):
        sel = [r for r in rows if r["kind"] == kind]
        for p, (marker, color) in zip(DEPTHS, zip("osD", ("tab:red", "tab:blue", "tab:green"))):
            if sel:
                ax.scatter([r["compute_over_comm"] for r in sel],
                           [r[f"exposed_depth{p}"] for r in sel],
                           marker=marker, facecolors=color if fill else "none", edgecolors=color,
                           label=f"{kind}, fsdp_ext, prefetch depth {p}")
        if sel:
            ax.scatter([r["compute_over_comm"] for r in sel],
                       [r["fsdp2_exposed_depth1_async"] for r in sel], marker="x" if fill else "+",
                       color="tab:gray", label=f"{kind}, FSDP2, depth 1, async unshard")
    ax.axhline(TARGET_EXPOSED, color="gray", ls="--", lw=0.8, label="15% target")
    ax.axvline(1.0, color="gray", ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("compute per unit ÷ all-gather per unit")
    ax.set_ylabel("exposed communication (t - t_compute) / t_comm")
    ax.set_title("forward overlap, gloo (filled/x: matmul, hollow/+: sleep)\n" + subtitle,
                 fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048],
                   help="unit: a d x d fp32 weight")
    p.add_argument("--matmuls", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="compute intensity: matmuls per unit")
    p.add_argument("--batch", type=int, default=32, help="rows of the activation")
    p.add_argument("--kinds", nargs="+", default=["matmul", "sleep"], choices=["matmul", "sleep"],
                   help="matmul: CPU compute (competes with gloo for the cores); sleep: idle host")
    p.add_argument("--sleep-ms", type=float, default=2.0, help="sleep per k in the sleep kind")
    p.add_argument("--units", type=int, default=12,
                   help="units in the chain (the first all-gather, 1/units of all, cannot hide)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.pt")
        launch(worker, args.world_size, args, path)
        rows = torch.load(path, weights_only=False)
    report(rows, args, sys.argv)


if __name__ == "__main__":
    main()
