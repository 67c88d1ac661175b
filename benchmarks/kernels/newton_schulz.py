"""Muon's Newton-Schulz one matrix at a time (torch.optim.Muon's way, fsdp_ext.optim.Muon's
default) against same-shape matrices batched (`batch_same_shape=True`), on the matrices one rank
orthogonalises in one step of a few model layouts: the time, the operators dispatched (each one
a kernel launch on the GPU) and how far the results are apart.

Measured on CPU (bf16 matrix products, --threads threads): the median of --repeats timed calls,
the two ways interleaved after an untimed warm-up; operators counted with a dispatch mode over one
call. The GPU's figures are not measured here: what batching saves there is launches, counted.

    python -m benchmarks.kernels.newton_schulz
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_ext.optim import newton_schulz

from ..common import RESULTS, command, machine, machine_line, markdown_table, write_results

# name -> the tensors one rank orthogonalises ((shape, how many), block rows): per-head blocks
# of attention projections (block_rows), expert stacks, whole square matrices
LAYOUTS = {
    "heads: 8 layers x q, k, v of 16 heads [64, 1024]": ([((1024, 1024), 24)], 64),
    "heads: 16 layers x q, k, v of 8 heads [32, 256]": ([((256, 256), 48)], 32),
    "experts: 8 layers x 8 experts [128, 256]": ([((8, 128, 256), 8)], None),
    "whole: 16 layers x 4 matrices [256, 256]": ([((256, 256), 64)], None),
}
GROUP = dict(ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def measure(name: str, repeats: int) -> dict:
    shapes, rows = LAYOUTS[name]
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen) for shape, count in shapes for _ in range(count)]
    ways = {way: {**GROUP, "block_rows": rows, "batch_same_shape": way == "batched"}
            for way in ("one by one", "batched")}
    results, ops, times = {}, {}, {way: [] for way in ways}
    for way, group in ways.items():
        with _Count() as count:
            results[way] = newton_schulz.orthogonalised(tensors, group)
        ops[way] = count.ops
    for _ in range(repeats):
        for way, group in ways.items():
            start = time.perf_counter()
            newton_schulz.orthogonalised(tensors, group)
            times[way].append(time.perf_counter() - start)
    apart = max((a.float() - b.float()).abs().max().item()
                for a, b in zip(results["one by one"], results["batched"]))
    matrices = sum(t.numel() for t in tensors) // (rows * tensors[0].shape[-1] if rows else
                                                   tensors[0].shape[-2] * tensors[0].shape[-1])
    return dict(layout=name, matrices=matrices,
                one_by_one_s=statistics.median(times["one by one"]),
                batched_s=statistics.median(times["batched"]),
                one_by_one_ops=ops["one by one"], batched_ops=ops["batched"],
                largest_difference=apart)


def report(rows: list[dict], cmd: str, threads: int) -> str:
    table = [[r["layout"], r["matrices"], f"{1e3 * r['one_by_one_s']:.1f}",
              f"{1e3 * r['batched_s']:.1f}", f"{r['batched_s'] / r['one_by_one_s']:.2f}",
              r["one_by_one_ops"], r["batched_ops"], f"{r['largest_difference']:.1e}"]
             for r in rows]
    return "\n".join([
        "# Newton-Schulz: one matrix at a time vs same-shape matrices batched", "",
        f"`{cmd}`", "", machine_line(machine()) + f"; {threads} thread(s)", "",
        "Times: median ms per call (CPU, bf16 products). Operators: dispatched per call (a kernel "
        "launch each on the GPU). Difference: largest elementwise gap between the two results "
        "(bf16 rounding of batched against single products).", "",
        markdown_table(["layout (one rank's matrices in one step)", "matrices",
                        "one by one ms", "batched ms", "batched / one by one",
                        "operators one by one", "operators batched", "difference"], table), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(name, args.repeats) for name in LAYOUTS]
    text = report(rows, command("benchmarks.kernels.newton_schulz"), args.threads)
    write_results(args.out, "newton_schulz", text, {"rows": rows, "threads": args.threads})
    print(text)


if __name__ == "__main__":
    main()
