"""Kernel microbenchmark: fsdp_ext ops vs plain-torch equivalents vs a copy_ of the same bytes.

For three realistic units (one transformer block of a 1B model, 1000 small tensors of odd sizes,
one 256 MB tensor) and each op case, times every available backend of `fsdp_ext.ops`
(cpp when fsdp_ext._C is built; triton on CUDA only, since the CPU interpreter measures nothing
useful; torch, the reference), the best plain-torch ways to do the same work, and
`dst.copy_(src)` on one tensor of the same dtype pair and element count, the memory-bandwidth limit.

Reports the median of --repeats samples after warm-up (the samples of all implementations of a case
interleaved; each sample starts from warm caches, an untimed call first, or with --cold from caches
evicted before each single timed call), GB/s (bytes read + written), the fraction of the same-run
copy_ bandwidth, and the speedup over `torch._foreach_copy_` (or its closest foreach equivalent).
Prints a markdown table; writes JSON (--out) and optionally the table (--md).

    python -m benchmarks.kernels.bench_kernels --threads 1 2
    python -m benchmarks.kernels.bench_kernels --threads 1 --cold        # data from memory
    python -m benchmarks.kernels.bench_kernels --quick --backends torch  # smoke run, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from fsdp_ext import ops

from ..common import RESULTS, cpu_model

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
I8, FP8 = torch.int8, torch.float8_e4m3fn
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
QUANT_BLOCK = 256  # values per quantization block, CommPolicy's default


# ---- units ---------------------------------------------------------------------------------------

def transformer_block(d: int, ffn: int) -> list[tuple[int, ...]]:
    """qkv and output projections, two MLP matrices, two norm weights (d=2048, ffn=8192: 50M)."""
    return [(3 * d, d), (d, d), (ffn, d), (d, ffn), (d,), (d,)]


def small_tensors(count: int, max_numel: int) -> list[tuple[int, ...]]:
    """`count` tensors of varied odd sizes in [1, max_numel] (deterministic)."""
    gen = torch.Generator().manual_seed(0)
    halves = torch.randint(0, max_numel // 2 + 1, (count,), generator=gen)
    return [(2 * int(k) + 1,) for k in halves]


FULL_UNITS = {
    "block_1b": transformer_block(2048, 8192),
    "small_1000": small_tensors(1000, 4095),
    "large_256mb": [(64 * 2**20,)],
}
QUICK_UNITS = {
    "block_1b": transformer_block(64, 256),
    "small_1000": small_tensors(1000, 63),
    "large_256mb": [(2**18,)],
}


# ---- op cases ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    op: str  # pack / unpack / cast_into_slot / grad_epilogue / quantize_into / dequantize_from
    #          / dequantize_sum
    src: torch.dtype
    dst: torch.dtype
    scale: float = 1.0    # pack
    divisor: float = 1.0  # grad_epilogue
    accumulate: bool = False
    world: int = 1        # dequantize_sum: slots summed

    @property
    def name(self) -> str:
        scaled = f" x{self.scale:g}" if self.scale != 1.0 else ""
        divided = f" /{self.divisor:g}" if self.divisor != 1.0 else ""
        accumulated = " +=" if self.accumulate else ""
        summed = f" w{self.world}" if self.op == "dequantize_sum" else ""
        return (f"{self.op} {DTYPE_NAMES[self.src]}->{DTYPE_NAMES[self.dst]}{scaled}{divided}"
                f"{accumulated}{summed}")


# The epilogue divides by 3, world 3's post-divide: a division (the power-of-two divisors of
# worlds 2 and 4 cost the same).
CASES = [Case("pack", F32, F32), Case("pack", F32, BF16), Case("pack", F32, F32, scale=0.125),
         Case("unpack", F32, F32), Case("cast_into_slot", F32, BF16),
         Case("grad_epilogue", BF16, F32, divisor=3.0, accumulate=True),
         Case("quantize_into", F32, I8), Case("quantize_into", F32, FP8),
         Case("quantize_into", BF16, I8), Case("quantize_into", BF16, FP8),
         Case("quantize_into", F16, I8), Case("quantize_into", F16, FP8),
         Case("dequantize_from", I8, F32), Case("dequantize_from", FP8, F32),
         Case("dequantize_sum", I8, F32, world=4), Case("dequantize_sum", FP8, F32, world=4)]
QUANTIZED_OPS = ("quantize_into", "dequantize_from", "dequantize_sum")


def _randn(shape, dtype, device):
    return torch.randn(shape, device=device).to(dtype)


def candidates(case: Case, shapes, device, backends):
    """(impl name, kind, zero-argument callable, bytes moved) for every way to run `case`."""
    sizes = [torch.Size(s).numel() for s in shapes]
    total = sum(sizes)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    bytes_in, bytes_out = total * case.src.itemsize, total * case.dst.itemsize
    moved = bytes_in + bytes_out + (bytes_out if case.accumulate else 0)
    quantized = case.op in QUANTIZED_OPS
    if quantized:  # the slots' bytes: codes and one fp32 scale per block, `world` slots
        starts = torch.arange(0, total, QUANT_BLOCK, device=device)
        fmt = "int8" if torch.int8 in (case.src, case.dst) else "fp8"
        slot_bytes = ops.slot_bytes(total, starts.numel())
        moved = (total * case.src.itemsize if case.src.itemsize > 1
                 else case.world * slot_bytes) + (total * case.dst.itemsize
                                                  if case.dst.itemsize > 1 else slot_bytes)
    out = []

    def add(name, kind, fn):
        out.append((name, kind, fn, moved))

    if case.op == "pack":
        srcs = [_randn(s, case.src, device) for s in shapes]
        flat_srcs = [s.view(-1) for s in srcs]
        buf = torch.empty(total, dtype=case.dst, device=device)
        views = list(buf.split(sizes))
        rescale = (lambda: buf.mul_(case.scale)) if case.scale != 1.0 else (lambda: None)
        for b in backends:
            add(b, "fsdp_ext", lambda b=b: ops.pack(srcs, offsets, buf, 0, case.scale, backend=b))
        add("torch._foreach_copy_", "foreach",
            lambda: (torch._foreach_copy_(views, flat_srcs), rescale()))
        if case.scale == 1.0:
            add("torch.cat().to()", "torch", lambda: torch.cat(flat_srcs).to(case.dst))
        else:
            add("torch.cat().mul_().to()", "torch",
                lambda: torch.cat(flat_srcs).mul_(case.scale).to(case.dst))
        add("torch._chunk_cat", "torch",
            lambda: (torch._chunk_cat(flat_srcs, 0, 1, out=buf.view(1, -1)), rescale()))
    elif case.op == "unpack":
        src = _randn(total, case.src, device)
        dsts = [torch.empty(s, dtype=case.dst, device=device) for s in shapes]
        flat_dsts = [d.view(-1) for d in dsts]
        for b in backends:
            add(b, "fsdp_ext", lambda b=b: ops.unpack(src, 0, offsets, dsts, backend=b))
        add("torch._foreach_copy_", "foreach",
            lambda: torch._foreach_copy_(flat_dsts, list(src.split(sizes))))
        if case.src == case.dst:
            add("torch.split_with_sizes_copy", "torch",
                lambda: torch.split_with_sizes_copy(src, sizes, 0, out=flat_dsts))
    elif case.op == "cast_into_slot":
        shard = _randn(total, case.src, device)
        gathered = torch.empty(2 * total, dtype=case.dst, device=device)
        for b in backends:
            add(b, "fsdp_ext", lambda b=b: ops.cast_into_slot(shard, gathered, 1, backend=b))
        add("torch._foreach_copy_", "foreach",
            lambda: torch._foreach_copy_([gathered[total:]], [shard]))
    elif case.op == "grad_epilogue":
        reduced = _randn(total, case.src, device)
        grad = _randn(total, case.dst, device)
        for b in backends:
            add(b, "fsdp_ext", lambda b=b: ops.grad_epilogue(reduced, grad, case.divisor,
                                                             case.accumulate, backend=b))
        add("torch._foreach_add_", "foreach",
            lambda: torch._foreach_add_([grad], [reduced], alpha=1.0 / case.divisor))
        add("Tensor.add_", "torch", lambda: grad.add_(reduced, alpha=1.0 / case.divisor))
    elif case.op == "quantize_into":
        values = _randn(total, case.src, device)
        slot = torch.empty(slot_bytes, dtype=torch.uint8, device=device)
        for b in backends:
            add(b, "fsdp_ext", lambda b=b: ops.quantize_into(values, slot, starts, fmt, backend=b))
    elif case.op == "dequantize_from":
        slot = torch.empty(slot_bytes, dtype=torch.uint8, device=device)
        ops.quantize_into(_randn(total, F32, device), slot, starts, fmt)
        out_values = torch.empty(total, dtype=case.dst, device=device)
        for b in backends:
            add(b, "fsdp_ext", lambda b=b: ops.dequantize_from(slot, out_values, starts, fmt,
                                                               backend=b))
    elif case.op == "dequantize_sum":
        wire = torch.empty(case.world * slot_bytes, dtype=torch.uint8, device=device)
        for r in range(case.world):
            ops.quantize_into(_randn(total, F32, device), wire[r * slot_bytes:][:slot_bytes],
                              starts, fmt)
        out_values = torch.empty(total, dtype=case.dst, device=device)
        for b in backends:
            add(b, "fsdp_ext", lambda b=b: ops.dequantize_sum(wire, out_values, starts, case.world,
                                                              slot_bytes, fmt, backend=b))
    # The limit: one copy_ of the same element count and dtype pair (bytes of one read + one write).
    # (For the quantized ops: a cast copy_ between the value dtype and the code dtype, the same
    # element count; for dequantize_sum, which reads `world` slots, a byte copy_ moving as many
    # bytes as it does, half read and half written.)
    if case.op == "dequantize_sum":
        limit_src = torch.randint(0, 256, (moved // 2,), dtype=torch.uint8, device=device)
        limit_dst = torch.empty_like(limit_src)
        bytes_in = bytes_out = moved // 2
    else:
        limit_src = _randn(total, case.src if case.src.itemsize > 1 else F32, device).to(case.src)
        limit_dst = torch.empty(total, dtype=case.dst, device=device)
    out.append(("copy_ (limit)", "limit", lambda: limit_dst.copy_(limit_src), bytes_in + bytes_out))
    return out


# ---- timing --------------------------------------------------------------------------------------

class Timer:
    """Times one zero-argument callable. Fast calls are batched so that one sample lasts at least
    `min_sample_s` (timer and scheduler noise would dominate a few-microsecond sample).

    Every sample starts from the same cache state for every implementation, whatever its number of
    calls: by default one untimed call right before the sample (warm: the unit's data is in cache,
    as far as it fits, as after the implementation's own previous call); with `evict`, a write of
    that many bytes before each single timed call (cold: the data comes from memory). Without
    either, a sample's first call would find the caches as the previous implementation left them,
    and how much that weighs would depend on how many calls the sample holds, i.e. on the
    implementation's own speed."""

    def __init__(self, fn, device: torch.device, warmup: int, min_sample_s: float = 2e-3,
                 evict: torch.Tensor | None = None):
        self.fn = fn
        self.evict = evict
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        for _ in range(warmup):
            fn()
        self.sync()
        self.calls = 1
        while (evict is None and self.calls < 10_000
               and (elapsed := self._run(self.calls)) < min_sample_s):
            needed = int(self.calls * 1.2 * min_sample_s / max(elapsed, 1e-9))
            self.calls = max(2 * self.calls, needed)
        self.samples: list[float] = []

    def _run(self, calls: int) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            self.fn()
        self.sync()  # on CUDA, time the kernels, not the launches
        return time.perf_counter() - start

    def sample(self) -> None:
        if self.evict is not None:
            self.evict.add_(1)
        else:
            self.fn()
        self.sync()
        self.samples.append(self._run(self.calls) / self.calls)


def run_unit_case(unit, shapes, case, device, backends, threads, repeats, warmup, evict=None):
    impls = candidates(case, shapes, device, backends)
    timers = [Timer(fn, device, warmup, evict=evict) for _, _, fn, _ in impls]
    # Interleave the samples of all implementations, so that a change in background load during
    # the run affects them alike and the ratios stay fair.
    for _ in range(repeats):
        for timer in timers:
            timer.sample()
    rows = []
    for (name, kind, _, moved), timer in zip(impls, timers):
        seconds = statistics.median(timer.samples)
        rows.append(dict(threads=threads, unit=unit, case=case.name, impl=name, kind=kind,
                         tensors=len(shapes), numel=sum(torch.Size(s).numel() for s in shapes),
                         bytes=moved, median_ms=seconds * 1e3, gbps=moved / seconds / 1e9,
                         min_ms=min(timer.samples) * 1e3,  # shows how much noise the median hides
                         calls_per_sample=timer.calls))
    copy_gbps = next(r["gbps"] for r in rows if r["kind"] == "limit")
    foreach_ms = next((r["median_ms"] for r in rows if r["kind"] == "foreach"), None)
    for r in rows:
        r["vs_copy"] = r["gbps"] / copy_gbps
        r["speedup_vs_foreach"] = foreach_ms / r["median_ms"] if foreach_ms else None
    return rows


# ---- targets and report --------------------------------------------------------------------------

def check_targets(rows) -> list[dict]:
    """Large units: pack/cast >= 0.9x copy_ bandwidth. 1000 small tensors: pack/unpack >= 2x faster
    than torch._foreach_copy_. Quantize / dequantize (values <-> codes): >= 0.5x copy_ bandwidth of
    the cast between them (dequantize_sum: of a byte copy). Checked for the compiled backends (cpp, triton)."""
    targets = []
    for r in rows:
        if r["impl"] not in ("cpp", "triton"):
            continue
        op = r["case"].split()[0]
        where = {k: r[k] for k in ("threads", "unit", "case", "impl")}
        if r["unit"] != "small_1000" and op in ("pack", "cast_into_slot"):
            value = r["vs_copy"]
            targets.append(dict(where, target="vs_copy >= 0.9", value=value, met=value >= 0.9))
        if r["unit"] == "small_1000" and op in ("pack", "unpack"):
            value = r["speedup_vs_foreach"]
            targets.append(dict(where, target="speedup_vs_foreach >= 2", value=value,
                                met=value >= 2))
        if r["unit"] != "small_1000" and op in QUANTIZED_OPS:
            value = r["vs_copy"]
            targets.append(dict(where, target="vs_copy >= 0.5", value=value, met=value >= 0.5))
    return targets


def markdown(rows, targets) -> str:
    lines = ["| threads | unit | case | impl | ms | GB/s | x copy_ | vs _foreach_copy_ |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['unit']} | {r['case']} | {r['impl']} | "
                     f"{r['median_ms']:.3f} | {r['gbps']:.2f} | {r['vs_copy']:.2f} | "
                     + (f"{r['speedup_vs_foreach']:.2f}x |" if r["speedup_vs_foreach"] else "- |"))
    if targets:
        lines += ["", "| threads | unit | case | impl | target | value | met |",
                  "|---|---|---|---|---|---:|---|"]
        for t in targets:
            lines.append(f"| {t['threads']} | {t['unit']} | {t['case']} | {t['impl']} | "
                         f"{t['target']} | {t['value']:.2f} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines)


def describe(result: dict) -> str:
    """A few lines saying where and how the numbers were measured."""
    m = result["machine"]
    where = m.get("gpu") or f"{m['cpu']}, {m['cpu_count']} cores"
    starts, ends = m["load_average_at_start"], m["load_average_at_end"]
    if not isinstance(starts[0], list):  # one run; merged reports hold one entry per run
        starts, ends = [starts], [ends]
    load = ", ".join(f"{a[0]:.2f} -> {b[0]:.2f}" for a, b in zip(starts, ends))
    notes = "; ".join(result["notes"]) or "none"
    caches = {"warm": "caches warm (an untimed call before each sample)",
              "cold": "caches cold (evicted before each timed call)"}.get(
        result.get("caches"), "caches as the previous implementation left them")
    return (f"Device: {m['device']} ({where}); torch {m['torch']}; "
            f"{'quick sizes' if result['quick'] else 'full sizes'}; median of {result['repeats']} "
            f"samples after {result['warmup']} warm-up runs, {caches}; "
            f"1-min load average per run {load}.\n"
            f"Backends timed: {', '.join(result['backends'])}. Skipped: {notes}.\n"
            f"GB/s counts bytes read + written; 'x copy_' = GB/s / GB/s of a same-size copy_; "
            f"'vs _foreach_copy_' = its time / this time.\n")


def machine_info(device: torch.device) -> dict:
    info = dict(platform=platform.platform(), python=platform.python_version(),
                torch=torch.__version__, device=str(device), cpu=cpu_model(),
                cpu_count=os.cpu_count(), load_average_at_start=os.getloadavg())
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def available_backends(device: torch.device,
                       wanted: list[str] | None) -> tuple[list[str], list[str]]:
    """(backends to time, notes on the ones skipped)."""
    have, notes = [], []
    compiled = "cuda" if device.type == "cuda" else "cpp"
    if ops.HAVE_EXTENSION:
        have.append(compiled)
    else:
        notes.append(f"{compiled} (fsdp_ext._C is not built)")
    if device.type == "cuda":
        have.append("triton")
    else:
        notes.append("triton (on CPU only its interpreter runs, which is no speed measurement)")
    have.append("torch")
    if wanted:
        notes += [f"{b} (not requested)" for b in have if b not in wanted]
        have = [b for b in have if b in wanted]
    return have, notes


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()],
                        help="torch.set_num_threads values to run (CPU)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--cold", action="store_true",
                        help="evict the caches before each timed call (one call per sample) "
                             "instead of timing warm calls")
    parser.add_argument("--evict-mib", type=int, default=256,
                        help="with --cold: MiB written to evict the caches")
    parser.add_argument("--backends", nargs="+", help="fsdp_ext backends to time (default: all)")
    parser.add_argument("--ops", nargs="+", help="only the cases of these ops (e.g. quantize_into)")
    parser.add_argument("--units", nargs="+", help="only these units (e.g. large_256mb)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--out", default=os.path.join(RESULTS, "kernels.json"))
    parser.add_argument("--md", help="also write the markdown table here")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="instead of running, combine earlier results (e.g. one run per thread "
                             "count, each taken while the machine was quiet) into --out / --md")
    args = parser.parse_args(argv)
    if args.merge:
        return write_report(merge_results(args.merge), args.out, args.md)

    device = torch.device(args.device if args.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    backends, notes = available_backends(device, args.backends)
    machine = machine_info(device)  # before the runs: records the load average at the start
    units = QUICK_UNITS if args.quick else FULL_UNITS
    torch.manual_seed(0)
    evict = torch.zeros(args.evict_mib << 18, device=device) if args.cold else None  # fp32
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for unit, shapes in units.items():
            if args.units and unit not in args.units:
                continue
            for case in CASES:
                if args.ops and case.op not in args.ops:
                    continue
                rows += run_unit_case(unit, shapes, case, device, backends, threads, args.repeats,
                                      args.warmup, evict)
                print(f"# threads={threads} {unit} {case.name} done", file=sys.stderr, flush=True)
    load_at_end = os.getloadavg()  # other work on the machine skews CPU timings: record it
    result = dict(machine=dict(machine, load_average_at_end=load_at_end), quick=args.quick,
                  caches="cold" if args.cold else "warm", repeats=args.repeats,
                  warmup=args.warmup, backends=backends, notes=notes,
                  units={u: dict(tensors=len(s), numel=sum(torch.Size(x).numel() for x in s))
                         for u, s in units.items()},
                  rows=rows, targets=check_targets(rows))
    return write_report(result, args.out, args.md)


def merge_results(paths: list[str]) -> dict:
    """One report from several runs of the same configuration; machine info from the first, load
    averages from all (runs taken at different times can each be checked for interference)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    merged = dict(runs[0], rows=[r for run in runs for r in run["rows"]])
    merged["machine"] = dict(runs[0]["machine"])
    merged["machine"]["load_average_at_start"] = [run["machine"]["load_average_at_start"]
                                                  for run in runs]
    merged["machine"]["load_average_at_end"] = [run["machine"]["load_average_at_end"]
                                                for run in runs]
    merged["targets"] = check_targets(merged["rows"])
    return merged


def write_report(result: dict, out: str, md: str | None) -> dict:
    table = markdown(result["rows"], result["targets"])
    header = describe(result)
    print(header + "\n" + table)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    if md:
        with open(md, "w") as f:
            f.write(header + "\n" + table + "\n")
    return result


if __name__ == "__main__":
    main()
