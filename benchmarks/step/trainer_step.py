"""transformers' Trainer step time and memory: fsdp_ext (through fsdp_ext.integrations.accelerate)
beside torch's FSDP2 and DDP, the same Trainer script, world 2 on CPU/gloo.

Each implementation runs in fresh processes, `--runs` times, alternating (ddp, torch, fsdp_ext,
ddp, ...); the ratio is of the medians over runs.
A Llama of `--layers` x `--hidden` (untied), per-device batch 4 of 128 tokens, gradient
accumulation 1, clipping at 1.0, no checkpoints; a TrainerCallback times each optimizer step
(on_step_begin to on_step_end: forward, backward, reduction, clipping, optimizer); the first
`--warmup` steps are left out. Peak RSS is above the process's RSS just before the Trainer is built.

    .venv/bin/python -m benchmarks.step.trainer_step
    .venv/bin/python -m benchmarks.step.trainer_step --tensor-memory --runs 1 \\
        --name trainer_tensors_w2
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..common import (RESULTS, init_rank, launch, machine, machine_line, markdown_table,
                      write_results)
from ..memory import TensorMemory, current_bytes, peak_bytes, reset_peak, track_live_memory

IMPLEMENTATIONS = ("ddp", "torch", "fsdp_ext")


def worker(rank: int, world: int, port: int, impl: str, args, out: str) -> None:
    track_live_memory()
    init_rank(rank, world, port, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
              LOCAL_WORLD_SIZE=str(world))
    import fsdp_ext.integrations.accelerate as switch
    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                              TrainingArguments)

    if impl != "ddp":
        switch.enable(impl)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=8,
                      num_key_value_heads=8, max_position_embeddings=256,
                      tie_word_embeddings=False)
    ids = torch.randint(0, cfg.vocab_size, (4 * world * (args.steps + 1), 128),
                        generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    fsdp = dict(fsdp=True, fsdp_config={"version": 2,
                                        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    training = TrainingArguments(
        output_dir=os.path.join(out, "trainer"), max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-4, max_grad_norm=1.0, save_strategy="no", report_to=[],
        disable_tqdm=True, use_cpu=True, logging_steps=10**6,
        **(fsdp if impl != "ddp" else {}))
    reset_peak()
    base = current_bytes()
    # --tensor-memory: the profiler's count of live tensor bytes (it slows the steps down)
    profiler = TensorMemory(torch.device("cpu")) if args.tensor_memory else contextlib.nullcontext()
    with profiler:
        model = LlamaForCausalLM(cfg)
        numel = sum(p.numel() for p in model.parameters())
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[Timer()])
        with profiler.window() if args.tensor_memory else contextlib.nullcontext():
            trainer.train()
    sharded = type(trainer.model_wrapped).__module__.split(".")[0]
    result = dict(step_s=statistics.median(times[args.warmup:]), peak_rss=peak_bytes() - base,
                  numel=numel, sharded_by=sharded, wrapper=type(trainer.model_wrapped).__name__,
                  peak_tensors=profiler.peak_bytes()[0] if args.tensor_memory else None)
    with open(os.path.join(out, f"{impl}-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/fsdp_ext_trainer_bench")
    parser.add_argument("--name", default="trainer_step_w2", help="results file name")
    parser.add_argument("--tensor-memory", action="store_true",
                        help="also the peak of live tensor bytes (profiler; slower steps)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    results: dict[str, list[list[dict]]] = {}
    for _ in range(args.runs):
        for impl in IMPLEMENTATIONS:
            launch(worker, args.world_size, impl, args, args.dir)
            ranks = [json.load(open(os.path.join(args.dir, f"{impl}-{r}.json")))
                     for r in range(args.world_size)]
            results.setdefault(impl, []).append(ranks)
    numel = results["ddp"][0][0]["numel"]
    where = machine()
    header = (f"Llama {args.layers} x {args.hidden}, {numel / 1e6:.1f}M parameters, world "
              f"{args.world_size}, {args.steps} steps ({args.warmup} warm-up); "
              f"{machine_line(where)}")
    def steps(impl: str) -> list[float]:  # per run, the slowest rank's median step
        return [max(rank["step_s"] for rank in ranks) for ranks in results[impl]]

    ours = statistics.median(steps("fsdp_ext"))
    rows = []
    for impl, runs in results.items():
        rows.append([f"{impl} ({runs[0][0]['wrapper']}, {runs[0][0]['sharded_by']})",
                     " / ".join(f"{s:.3f}" for s in steps(impl)),
                     f"{ours / statistics.median(steps(impl)):.2f}",
                     " / ".join(f"{max(r['peak_rss'] for r in ranks) / 2**20:.0f}"
                                for ranks in runs)])
        if args.tensor_memory:
            rows[-1].append(" / ".join(f"{max(r['peak_tensors'] for r in ranks) / 2**20:.1f}"
                                       for ranks in runs))
    table = markdown_table(["implementation", "median step per run (s, slowest rank)",
                            "fsdp_ext ÷ this", "peak RSS above start per run (MiB, max of ranks)"]
                           + (["peak live tensors per run (MiB, max of ranks)"]
                              if args.tensor_memory else []), rows)
    print(header + "\n\n" + table)
    write_results(args.out, args.name, header + "\n\n" + table + "\n",
                  dict(machine=where, args=vars(args), results=results))


if __name__ == "__main__":
    main()
