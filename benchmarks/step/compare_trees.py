"""Step time and peak memory of two checkouts of fsdp_ext (a commit before a change, and after),
interleaved: round by round, each tree's `bench_step` run in fresh processes, the order of the
two trees alternating, so that a change in the load of a shared machine hits both alike.

Two builds of the package cannot live in one process (the compiled extension registers one op
namespace), so the unit interleaved is one `bench_step --timing sequential` run per tree: each
framework steps alone in its own launch and reports its median step, its tensor peak and its
RSS peak above the process's baseline (benchmarks/step/bench_step.py, phase 1).

    git worktree add /tmp/before <commit>; cp fsdp_ext/_C*.so /tmp/before/fsdp_ext/  # (or build)
    python -m benchmarks.step.compare_trees --before /tmp/before --after . --rounds 4 \\
        --world-sizes 2 4

Each tree is imported from its own folder (`python -m` puts the working directory first on the
path) with this interpreter's packages.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

LINE = re.compile(r"alone (\S+): median ([\d.]+) s, tensor peak (\d+) MiB, RSS peak \+(\d+) MiB")


def run_tree(tree: str, world: int, frameworks: list[str], steps: int, warmup: int) -> dict:
    """One bench_step run from `tree`: framework -> (median s, tensor peak MiB, RSS peak MiB)."""
    cmd = [sys.executable, "-m", "benchmarks.step.bench_step", "--world-size", str(world),
           "--timing", "sequential", "--no-plan", "--steps", str(steps), "--warmup",
           str(warmup), "--frameworks", *frameworks, "--out", os.path.join(tree, "out", "cmp")]
    out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=True).stdout
    return {m[1]: (float(m[2]), int(m[3]), int(m[4])) for m in LINE.finditer(out)}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", required=True, help="checkout of the commit before")
    p.add_argument("--after", default=".", help="checkout of the commit after")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--frameworks", nargs="+", default=["fsdp_ext", "fsdp_ext-flat"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    samples: dict[tuple, list] = {}
    for r in range(args.rounds):
        for world in args.world_sizes:
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for which in order:
                found = run_tree(trees[which], world, args.frameworks, args.steps, args.warmup)
                for name, value in found.items():
                    samples.setdefault((world, name, which), []).append(value)
                print(f"round {r + 1} world {world} {which}: "
                      + ", ".join(f"{n} {v[0]:.3f} s {v[2]} MiB" for n, v in found.items()),
                      flush=True)
    print("\nworld framework   tree    step s median [min, max]    tensor peak MiB   RSS peak MiB")
    for world in args.world_sizes:
        for name in args.frameworks:
            for which in ("before", "after"):
                got = samples.get((world, name, which), [])
                if not got:
                    continue
                print(f"{world:5d} {name:12s} {which:6s}  {spread([g[0] for g in got]):28s}"
                      f"  {statistics.median(g[1] for g in got):15.0f}"
                      f"  {statistics.median(g[2] for g in got):13.0f}")
            before = samples.get((world, name, "before"))
            after = samples.get((world, name, "after"))
            if before and after:
                ratio = (statistics.median(a[0] for a in after)
                         / statistics.median(b[0] for b in before))
                print(f"{world:5d} {name:12s} after/before step time {ratio:.3f}")


if __name__ == "__main__":
    main()
