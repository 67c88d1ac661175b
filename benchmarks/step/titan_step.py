"""torchtitan's own trainer with torch's FSDP2 and with fsdp_ext swapped in (tests/helpers/titan_cpu.py:
the swap and the CPU shims), side by side: per configuration, `--runs` runs of each
implementation, interleaved (torch, fsdp_ext, torch, ...), each `--steps` steps of
`llama3_debugmodel` at sequence 128.

Per run: the median over steps 3.. of torchtitan's own throughput (tokens/s per rank) and step
time (its end-to-end seconds), its peak memory line (on CPU the process's peak resident set), and
the gradient reductions the run issued and the elements they sent, per step (rank 0; torch's
reduce-scatters, fsdp_ext's bucket reductions). The report gives the medians over runs, the
ratio of fsdp_ext's step time to torch's, and whether the losses and grad norms were bitwise
equal in every pair.

    .venv/bin/python -m benchmarks.step.titan_step                      # default, PP, ZBV, compile
    .venv/bin/python -m benchmarks.step.titan_step --configs pp_1f1b --runs 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from ..common import RESULTS, command, machine, machine_line, markdown_table, write_results

# name: (world size, the trainer's arguments beyond tests/titan_cpu.SMALL, what it is)
CONFIGS = {
    "default": (2, [], "FSDP 2 (chunked loss, selective AC)"),
    "pp_1f1b": (4, ["--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.pipeline_parallel_schedule", "1F1B"], "PP 2 x FSDP 2, 1F1B"),
    # ZBV: the unchunked loss (under the chunked one torch's FSDP2 loses the final norm's
    # gradient) and no activation checkpointing (torch's run fails on CPU under the selective
    # one); the subcommand last, after an option that ends --override.imports' list
    "pp_zbv": (4, ["--override.imports", "tests.helpers.titan_overrides.unchunked_loss",
                   "--parallelism.pipeline_parallel_degree", "2",
                   "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
                   "activation_checkpoint:none"],
               "PP 2 x FSDP 2, ZBVZeroBubble (unchunked loss, no AC)"),
    "compile": (2, ["--compile.enable", "--compile.components", "model",
                    "--compile.backend", "aot_eager"],
                "FSDP 2, per-block compile(fullgraph=True), aot_eager"),
}
COMPARED = ("loss_metrics/global_avg_loss", "grad_norm")


def one_run(impl: str, config: str, steps: int, assets, root: str) -> dict:
    from tests.helpers.titan_cpu import SMALL, launch

    world, extra, _ = CONFIGS[config]
    out = tempfile.mkdtemp(prefix=f"{config}_{impl}_", dir=root)
    records, _ = launch(impl, out, assets, ["--training.steps", str(steps), *extra],
                        world_size=world, deadline_s=1200.0, base=SMALL)
    with open(os.path.join(out, "grad_collectives.json")) as f:
        reductions = json.load(f)
    steady = [r for r in records if r["step"] >= 3]
    return {
        "tps": statistics.median(r["throughput(tps)"] for r in steady),
        "step_s": statistics.median(r["time_metrics/end_to_end(s)"] for r in steady),
        "peak_gib": max(r["memory/max_active(GiB)"] for r in records),
        "reductions_per_step": reductions["calls"] / steps,
        "elements_per_step": reductions["elements"] / steps,
        "trajectory": [[r["step"], *(r.get(k) for k in COMPARED)] for r in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--name", default="titan_step")
    args = parser.parse_args()
    from tests.helpers.titan_cpu import make_assets

    root = tempfile.mkdtemp(prefix="titan_step_")
    assets = make_assets(os.path.join(root, "assets"))
    results = {}
    for config in args.configs:
        runs = {"torch": [], "fsdp_ext": []}
        for _ in range(args.runs):
            for impl in runs:
                runs[impl].append(one_run(impl, config, args.steps, assets, root))
                print(config, impl, {k: v for k, v in runs[impl][-1].items()
                                     if k != "trajectory"}, flush=True)
        results[config] = runs
    rows = []
    for config, runs in results.items():
        med = {impl: {k: statistics.median(r[k] for r in rs) for k in
                      ("tps", "step_s", "peak_gib", "reductions_per_step", "elements_per_step")}
               for impl, rs in runs.items()}
        bitwise = all(a["trajectory"] == b["trajectory"]
                      for a, b in zip(runs["torch"], runs["fsdp_ext"]))
        for impl in ("torch", "fsdp_ext"):
            m = med[impl]
            rows.append([CONFIGS[config][2] + f" (world {CONFIGS[config][0]})", impl,
                         f"{m['tps']:.0f}", f"{m['step_s']:.2f}", f"{m['peak_gib']:.2f}",
                         f"{m['reductions_per_step']:.1f}",
                         f"{m['elements_per_step'] / 1e6:.2f} M",
                         f"{m['step_s'] / med['torch']['step_s']:.2f}",
                         "yes" if bitwise else "no"])
    m = machine()
    text = "\n".join([
        f"# torchtitan's trainer: torch's FSDP2 and fsdp_ext ({args.runs} runs each, interleaved,"
        f" {args.steps} steps, medians)", "",
        f"Machine: {machine_line(m)}.", f"Command: `{command('benchmarks.step.titan_step')}`", "",
        markdown_table(["configuration", "implementation", "tokens/s per rank", "s/step",
                        "peak GiB (rank 0)", "gradient reductions/step",
                        "elements reduced/step", "step time vs torch", "bitwise equal"], rows),
        ""])
    print(text)
    write_results(RESULTS, args.name, text, {"machine": m, "args": vars(args),
                                             "results": results})


if __name__ == "__main__":
    main()
