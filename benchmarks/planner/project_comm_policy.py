"""PROJECTION (nothing here is measured): what a CommPolicy would gain on H100 clusters of 8 to 64
GPUs, by the planner's alpha-beta model (fsdp_ext/planner/comm_model.py) with the bytes each
setting puts on the wire (int8/fp8 codes plus one fp32 scale per 256 values; bf16 gradients) and
its quantize / dequantize passes charged at HBM bandwidth, none of them overlapped (a bound).

Models and per-GPU work as in project_plan.py (one 4096-token sequence per GPU, bf16 parameters
for compute, fp32 reduction, state and AdamW; prefetch 1; FULL_SHARD, whose rings leave the node
from 16 GPUs on: 50 GB/s per GPU instead of NVLink's 450).

    python -m benchmarks.planner.project_comm_policy
"""
from __future__ import annotations

import argparse

from torch import nn

from fsdp_ext import CommPolicy
from fsdp_ext.planner.comm_model import H100
from fsdp_ext.planner.plan import project

from ..common import RESULTS, command, markdown_table, write_results
from .project_plan import SEQ, build

MODELS = {"6.4B": (32, 4096, 32, 16384), "0.2B": (16, 1024, 16, 4096)}
WORLDS = [8, 16, 32, 64]
SETTINGS = {"exact": None, "int8 weights": CommPolicy("int8"),
            "int8 weights + int8 gradients": CommPolicy("int8", "int8"),
            "fp8 weights + bf16 gradients": CommPolicy("fp8", "bf16")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()
    sections, data = [], {}
    for name, (layers, d, heads, ffn) in MODELS.items():
        model = build(layers, d, heads, ffn)
        params = sum(q.numel() for q in model.parameters())
        flops = 6 * params * SEQ + 12 * layers * d * SEQ * SEQ
        steps = {}
        for label, policy in SETTINGS.items():
            plans = project(model, WORLDS, H100, unit_classes={nn.TransformerEncoderLayer},
                            flops_per_step=flops, activation_bytes=34 * SEQ * d * layers,
                            strategies=("FULL_SHARD",), comm_policy=policy)
            steps[label] = {w: plans[w].estimates[0].time for w in WORLDS}
        rows = []
        for world in WORLDS:
            exact = steps["exact"][world]["step"]
            for label in SETTINGS:
                t = steps[label][world]
                rows.append([world, label, f"{t['comm']:.3f}", f"{t['exposed_comm']:.3f}",
                             f"{t['quantize']:.4f}", f"{t['step']:.3f}",
                             f"{exact / t['step']:.3f}"])
        data[name] = {label: {str(w): t for w, t in per.items()} for label, per in steps.items()}
        sections += [f"#### {name}: {params / 1e9:.2f}B parameters, {layers} blocks of d_model {d}",
                     "", markdown_table(["GPUs", "setting", "comm (s)", "exposed comm (s)",
                                         "quantize (s)", "step (s)", "speed-up vs exact"], rows),
                     ""]
    text = "\n".join([
        "### PROJECTION: CommPolicy on H100 clusters (estimated by fsdp_ext.plan, not measured)",
        "", f"`{command(__spec__.name)}`", "",
        f"{H100.name}; {H100.peak_flops / 1e12:.0f} TFLOP/s bf16 at {100 * H100.mfu:.0f}% MFU, "
        f"HBM {H100.memory_bandwidth / 1e12:.2f} TB/s; one {SEQ}-token sequence per GPU; "
        "FULL_SHARD, prefetch 1.", "", *sections])
    print(text)
    write_results(args.out, "comm_policy_projection", text,
                  dict(label="PROJECTION, not measured", models=data))


if __name__ == "__main__":
    main()
