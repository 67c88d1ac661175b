"""The planner's error against the step benchmark's measurements.

For bench_step.py: `predict` runs on every rank of its launch (the planner measures the gloo link
and the compute with all ranks busy, as in training) and `compare` puts the prediction next to what
bench_step measured for fsdp_ext (its defaults: FULL_SHARD, prefetch depth --prefetch); both are
stored in each step_*.json. Run as a script, this collects predicted vs measured peak memory per
rank (tensor peak from the allocator, and peak RSS above baseline) and step time of every case in
a results directory into one table.

    python -m benchmarks.planner.validate_plan            # reads benchmarks/results/step_*.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_ext

from ..common import RESULTS, command, markdown_table, write_results
from ..step.frameworks import BLOCK_CLASS, build_model, make_batch

MEMORY_TOLERANCE = 0.10   # the targets for the planner
TIME_TOLERANCE = 0.20


def predict(cfg, device: torch.device, threads: int, prefetch: int) -> dict:
    """The planner's estimate for fsdp_ext on the step benchmark's model `cfg` (every rank)."""
    model = build_model(cfg, device)
    x, y = make_batch(cfg, dist.get_rank(), device)
    p = fsdp_ext.plan(model, dist.get_world_size(), unit_classes={BLOCK_CLASS},
                      loss_fn=lambda m: F.mse_loss(m(x), y), threads_per_rank=threads,
                      device_type=device.type, prefetch=(prefetch,), strategies=("FULL_SHARD",))
    e = p.estimate("FULL_SHARD", prefetch)
    return dict(memory=e.memory, time=e.time, link=vars(p.model.link), text=str(p))


def compare(prediction: dict, measured: dict) -> dict:
    """Relative errors (predicted / measured - 1) for peak memory and step time."""
    tensor_peak = max(measured["tensor_peak_per_rank"])
    rss_peak = max(measured["train_peak_per_rank"])
    out = dict(predicted_peak=prediction["memory"]["peak"], measured_tensor_peak=tensor_peak,
               measured_rss_peak=rss_peak, predicted_step=prediction["time"]["step"],
               measured_step=measured["median_s"])
    out["memory_error"] = out["predicted_peak"] / tensor_peak - 1
    out["memory_error_vs_rss"] = out["predicted_peak"] / rss_peak - 1
    out["time_error"] = out["predicted_step"] / out["measured_step"] - 1
    out["memory_met"] = abs(out["memory_error"]) <= MEMORY_TOLERANCE
    out["time_met"] = abs(out["time_error"]) <= TIME_TOLERANCE
    return out


def lines(check: dict) -> list[str]:
    """`compare`'s result as the step report's two lines."""
    mib = 2**20
    return [
        f"- planner, peak memory/rank: predicted {check['predicted_peak'] / mib:.0f} MiB, measured "
        f"{check['measured_tensor_peak'] / mib:.0f} MiB of tensors: error "
        f"{100 * check['memory_error']:+.1f}% (target within {100 * MEMORY_TOLERANCE:.0f}%: "
        f"{'met' if check['memory_met'] else 'missed'}); vs peak RSS above baseline "
        f"{check['measured_rss_peak'] / mib:.0f} MiB: {100 * check['memory_error_vs_rss']:+.1f}%",
        f"- planner, step time: predicted {check['predicted_step']:.3f} s, measured "
        f"{check['measured_step']:.3f} s: error {100 * check['time_error']:+.1f}% (target within "
        f"{100 * TIME_TOLERANCE:.0f}%: {'met' if check['time_met'] else 'missed'})"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--results", default=RESULTS)
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
    md = ["### Planner vs measurement (fsdp_ext, FULL_SHARD)", "",
          f"`{command(__spec__.name)}`", "", table, ""]
    if cases:
        memory_met = "met" if worst_memory <= MEMORY_TOLERANCE else "missed"
        time_met = "met" if worst_time <= TIME_TOLERANCE else "missed"
        md += [f"- worst memory error {100 * worst_memory:.1f}% (target within "
               f"{100 * MEMORY_TOLERANCE:.0f}%: {memory_met})",
               f"- worst step-time error {100 * worst_time:.1f}% (target within "
               f"{100 * TIME_TOLERANCE:.0f}%: {time_met})", ""]
    text = "\n".join(md)
    print(text)
    write_results(args.results, "plan_validation", text, dict(cases=cases))


if __name__ == "__main__":
    main()
