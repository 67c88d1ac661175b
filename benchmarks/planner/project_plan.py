"""PROJECTION (nothing here is measured): the planner on H100 clusters of 8 to 1024 GPUs.

Models are built on the meta device (no memory), as stacks of TransformerEncoderLayer blocks like
the step benchmark's, one unit per block. Per GPU: one sequence of 4096 tokens per step (the batch
grows with the cluster), bf16 parameters for compute, fp32 gradient reduction, fp32 sharded state
and AdamW. Stated inputs (fsdp_ext/planner/comm_model.py: H100): NVLink 450 GB/s per GPU inside a node of 8,
400 Gb/s InfiniBand per GPU between nodes, 989 TFLOP/s bf16 at 40% MFU, 80 GB per GPU.
  FLOPs per GPU step: 6 * params * tokens + 12 * layers * d_model * seq * tokens (attention)
  activations per GPU: 34 * seq * d_model bytes per layer (bf16, flash attention, no
  recomputation; Korthikanti et al. 2022, "Reducing Activation Recomputation"); with activation
  checkpointing per block, each block's bf16 input (2 * seq * d_model) plus one block's full set,
  and the forward computed twice (8 instead of 6 * params * tokens)
The ring model's latency term grows with the ranks in a ring ((W - 1) * alpha), which is why
FULL_SHARD's step time climbs at 1024 GPUs while HYBRID_SHARD (rings of 8 inside a node, then an
all-reduce of the shard across nodes) does not.

    python -m benchmarks.planner.project_plan
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from fsdp_ext.planner.comm_model import H100
from fsdp_ext.planner.plan import project

from ..common import RESULTS, command, markdown_table, write_results

MODELS = {  # name: (layers, d_model, heads, ffn, activation checkpointing)
    "0.2B (the step benchmark's --large)": (16, 1024, 16, 4096, False),
    "6.4B": (32, 4096, 32, 16384, False),
    "59B, activation checkpointing per block": (80, 8192, 64, 28672, True),
}
WORLDS = [8, 16, 32, 64, 128, 256, 512, 1024]
SEQ = 4096


def build(layers: int, d: int, heads: int, ffn: int) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(nn.TransformerEncoderLayer(d, heads, ffn, batch_first=True)
                               for _ in range(layers)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()
    gib = 2**30
    sections, data = [], {}
    for name, (layers, d, heads, ffn, recompute) in MODELS.items():
        model = build(layers, d, heads, ffn)
        params = sum(q.numel() for q in model.parameters())
        attention = 12 * layers * d * SEQ * SEQ
        if recompute:
            flops = 8 * params * SEQ + attention * 4 // 3
            activations = 2 * SEQ * d * layers + 34 * SEQ * d
        else:
            flops = 6 * params * SEQ + attention
            activations = 34 * SEQ * d * layers
        plans = project(model, WORLDS, H100, unit_classes={nn.TransformerEncoderLayer},
                        flops_per_step=flops, activation_bytes=activations)
        rows, data[name] = [], []
        for world, plan in plans.items():
            for e in plan.estimates:
                t, m = e.time, e.memory
                rows.append([world, e.setting.strategy, f"{m['peak'] / gib:.1f}",
                             "yes" if e.fits else "no", f"{t['step']:.3f}",
                             f"{t['comm']:.3f}", f"{t['exposed_comm']:.3f}",
                             f"{SEQ / t['step']:.0f}"])
                data[name].append(dict(world=world, strategy=e.setting.strategy, memory=m,
                                       time=t, fits=e.fits))
        sections += [f"#### {name}: {params / 1e9:.2f}B parameters, {layers} blocks of d_model {d}",
                     "", markdown_table(
                         ["GPUs", "strategy", "peak GiB/GPU", "fits 80 GB", "step (s)", "comm (s)",
                          "exposed comm (s)", "tokens/s/GPU"], rows), ""]
    text = "\n".join([
        "### PROJECTION to H100 clusters (estimated by fsdp_ext.plan, not measured)", "",
        f"`{command(__spec__.name)}`", "",
        f"Inputs as stated in benchmarks/planner/project_plan.py and "
        f"fsdp_ext/planner/comm_model.py: {H100.name}; "
        f"{H100.peak_flops / 1e12:.0f} TFLOP/s bf16 at {100 * H100.mfu:.0f}% MFU; one {SEQ}-token "
        "sequence per GPU per step; bf16 compute, fp32 reduction and state, AdamW; prefetch 1.", "",
        *sections])
    print(text)
    write_results(args.out, "plan_projection", text,
                  dict(label="PROJECTION, not measured", cluster=vars(H100) | {
                      "intra": vars(H100.intra), "inter": vars(H100.inter)}, seq=SEQ, models=data))


if __name__ == "__main__":
    main()
