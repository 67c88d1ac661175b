"""The host cost of one collective's tag: made (hash, description), exchanged and checked, on one
rank of a gloo group, against the same collective without a tag.

Each variant runs --collectives collectives through the runtime's own path, `comm.Streams.launch`
with the tag's maker and `Pending.wait`, with a data collective that does nothing, so what is left
is the tag (and launch's record around it):
    issue              CollectiveChecker.issue alone: the hash, the description, two allocations
    tag                launch + wait with the tag: issue, the 8-byte all-gather, the host check
    no tag             launch + wait with the tags off (FSDP_EXT_CHECK=off): the record alone
Per collective microseconds, the median of --reps repetitions, in a fresh process per round: the
calling thread's CPU time (what the tag costs the thread that issues and waits, without gloo's own
threads and the wait for them, and steady under other jobs' load) and the wall time.

With --before REV [REV ...] the same rounds also run the package as it was at each commit REV
(extracted into a temporary folder; the compiled extension is this checkout's), alternated round
by round with this checkout's, so all see the same machine load.

    python -m benchmarks.host.tag_cost
    python -m benchmarks.host.tag_cost --before main --rounds 4
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from fsdp_ext.runtime.comm import collectives as comm

from ..common import (RESULTS, command, free_port, init_rank, machine, machine_line, markdown_table,
                      write_results)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = ("issue", "tag", "no tag")
SIZES = [(4_194_304, "float32"), (1024, "float32")]  # a block's weights and its biases, say


def _checker_class():
    """The tags' checker, wherever the package being measured keeps it."""
    try:
        from fsdp_ext.runtime.comm.collective_tags import CollectiveChecker
    except ImportError:  # the package before the tags and the peer watch were two modules
        from fsdp_ext.runtime.fingerprints import CollectiveChecker
    return CollectiveChecker


def _per_collective_us(loop, n: int) -> tuple[float, float]:
    """(this thread's CPU time, wall time) per collective of `loop(n)`, microseconds."""
    cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
    loop(n)
    return (time.thread_time_ns() - cpu) / n / 1e3, (time.perf_counter_ns() - wall) / n / 1e3


def child(args) -> None:
    """One round in this process: every variant, interleaved repetition by repetition."""
    init_rank(0, 1, free_port())
    checker_class = _checker_class()
    device, group = torch.device("cpu"), dist.group.WORLD
    timeout = datetime.timedelta(seconds=60)
    sizes = [(n, getattr(torch, dtype)) for n, dtype in SIZES]
    streams_ = comm.Streams(device, timeout)

    def checker(mode: str):
        previous = os.environ.get("FSDP_EXT_CHECK")
        os.environ["FSDP_EXT_CHECK"] = mode
        try:
            return checker_class(device, timeout=timeout)
        finally:
            if previous is None:
                del os.environ["FSDP_EXT_CHECK"]
            else:
                os.environ["FSDP_EXT_CHECK"] = previous

    def nothing(async_op: bool) -> list:
        return []

    def issue_only(n: int) -> None:
        made = checker("on")  # its own: these tags are never exchanged
        for _ in range(n):
            made.issue(group, "all_gather", "blocks.3", sizes, "forward")

    def launched(mode: str):
        made = checker(mode)

        def loop(n: int) -> None:
            for _ in range(n):
                streams_.launch(
                    "all_gather", nothing, keep_alive=[], label="all_gather of unit 'blocks.3'",
                    tags=lambda: [made.issue(group, "all_gather", "blocks.3", sizes, "forward")],
                ).wait()
        return loop

    loops = {"issue": issue_only, "tag": launched("on"), "no tag": launched("off")}
    for loop in loops.values():  # warm-up
        loop(200)
    samples = {name: [] for name in loops}
    for _ in range(args.reps):
        for name, loop in loops.items():
            samples[name].append(_per_collective_us(loop, args.collectives))
    print(json.dumps({name: {"cpu": statistics.median(c for c, _ in v),
                             "wall": statistics.median(w for _, w in v)}
                      for name, v in samples.items()}))
    dist.destroy_process_group()


def _extract(rev: str, into: str) -> str:
    """The package at commit `rev` under `into`, with this checkout's compiled extension."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "fsdp_ext"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    for built in glob.glob(os.path.join(ROOT, "fsdp_ext", "_C*.so")):
        shutil.copy(built, os.path.join(into, "fsdp_ext"))
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], check=True,
                          capture_output=True, text=True).stdout.strip()


def _round(path: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, ROOT]))
    out = subprocess.run([sys.executable, "-m", "benchmarks.host.tag_cost", "--child",
                          "--collectives", str(args.collectives), "--reps", str(args.reps)],
                         cwd=path, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--collectives", type=int, default=2000, help="per repetition (default 2000)")
    p.add_argument("--reps", type=int, default=9, help="repetitions per round (default 9)")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per package (default 3)")
    p.add_argument("--before", metavar="REV", nargs="+", default=[],
                   help="also measure the package at these commits")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        packages = {}
        for i, rev in enumerate(args.before):
            path = os.path.join(tmp, str(i))
            os.makedirs(path)
            packages[_extract(rev, path)] = path
            # The benchmark itself runs from this checkout: only the package is the old one.
            shutil.copytree(os.path.join(ROOT, "benchmarks"), os.path.join(path, "benchmarks"),
                            ignore=shutil.ignore_patterns("results", "__pycache__"))
        packages["this checkout"] = ROOT
        results = {name: [] for name in packages}
        for _ in range(args.rounds):
            for name, path in packages.items():
                results[name].append(_round(path, args))
    rows = []
    for name, rounds in results.items():
        def cell(variant: str, clock: str) -> str:
            values = [r[variant][clock] for r in rounds]
            return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

        cpu = {v: statistics.median(r[v]["cpu"] for r in rounds) for v in VARIANTS}
        rows.append([name, *[cell(v, "cpu") for v in VARIANTS],
                     f"{cpu['tag'] - cpu['no tag']:.1f}", cell("tag", "wall"),
                     cell("no tag", "wall")])
    m, cmd = machine(), command("benchmarks.host.tag_cost")
    table = markdown_table(["package", "issue (CPU)", "tag: launch + wait (CPU)",
                            "no tag: launch + wait (CPU)", "the tag (CPU)", "tag (wall)",
                            "no tag (wall)"], rows)
    text = "\n".join([
        "### The host cost of a collective's tag, one gloo rank", "", f"`{cmd}`", "",
        f"Machine: {machine_line(m)}", "",
        f"Per collective, microseconds: median of {args.rounds} rounds (min-max), each the "
        f"median of {args.reps} repetitions of {args.collectives} collectives", "", table, ""])
    print(text)
    write_results(args.out, "tag_cost", text,
                  dict(command=cmd, machine=m, args=vars(args), us_per_collective=results))


if __name__ == "__main__":
    main()
