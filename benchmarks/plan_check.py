"""The planner's prediction for a bench_step.py case, and its error against the measurement.

`predict` runs on every rank of a launch (the planner measures the gloo link and the compute with
all ranks busy, as in training); `compare` puts the prediction next to what bench_step measured
for fsdp_ext (its defaults: FULL_SHARD, prefetch depth --prefetch).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_ext
from step_frameworks import BLOCK_CLASS, build_model, make_batch

MEMORY_TOLERANCE = 0.10   # the targets for the planner
TIME_TOLERANCE = 0.20


def predict(cfg, device: torch.device, threads: int, prefetch: int) -> dict:
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
