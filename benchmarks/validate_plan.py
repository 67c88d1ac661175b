"""The planner's error on every bench_step.py case in a results directory, in one table.

bench_step.py runs fsdp_ext.plan in the same processes (same machine load) as its measurements and
stores the prediction next to them; this collects predicted vs measured peak memory per rank
(tensor peak from the allocator, and peak RSS above baseline) and step time.

    python benchmarks/validate_plan.py            # reads benchmarks/results/step_*.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from plan_check import MEMORY_TOLERANCE, TIME_TOLERANCE  # noqa: E402
from results_io import markdown_table, write_json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    rows, cases = [], []
    for path in sorted(glob.glob(os.path.join(args.results, "step_*.json"))):
        with open(path) as f:
            data = json.load(f)
        check = data.get("plan_check")
        if not check:
            continue
        mib = 2**20
        cases.append(dict(file=os.path.basename(path), **check))
        rows.append([os.path.basename(path), f"{check['predicted_peak'] / mib:.0f}",
                     f"{check['measured_tensor_peak'] / mib:.0f}",
                     f"{100 * check['memory_error']:+.1f}%",
                     f"{check['measured_rss_peak'] / mib:.0f}",
                     f"{100 * check['memory_error_vs_rss']:+.1f}%",
                     f"{check['predicted_step']:.3f}", f"{check['measured_step']:.3f}",
                     f"{100 * check['time_error']:+.1f}%"])
    table = markdown_table(
        ["case", "predicted peak (MiB)", "measured tensors (MiB)", "error", "measured RSS (MiB)",
         "error vs RSS", "predicted step (s)", "measured step (s)", "error"], rows)
    worst_memory = max((abs(c["memory_error"]) for c in cases), default=None)
    worst_time = max((abs(c["time_error"]) for c in cases), default=None)
    lines = ["### Planner vs measurement (fsdp_ext, FULL_SHARD)", "",
             "`python benchmarks/validate_plan.py`", "", table, ""]
    if cases:
        memory_met = "met" if worst_memory <= MEMORY_TOLERANCE else "missed"
        time_met = "met" if worst_time <= TIME_TOLERANCE else "missed"
        lines += [f"- worst memory error {100 * worst_memory:.1f}% (target within "
                  f"{100 * MEMORY_TOLERANCE:.0f}%: {memory_met})",
                  f"- worst step-time error {100 * worst_time:.1f}% (target within "
                  f"{100 * TIME_TOLERANCE:.0f}%: {time_met})", ""]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.results, "plan_validation.md"), "w") as f:
        f.write(text)
    write_json(os.path.join(args.results, "plan_validation.json"), dict(cases=cases))


if __name__ == "__main__":
    main()
