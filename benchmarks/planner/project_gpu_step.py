"""PROJECTION (modelled, not measured): one steady-state training step of a Llama-style model,
replayed on a modelled node of 8 H100s, with the collective tags synchronous and without tags.

For each mode of the collective tags (FSDP_EXT_CHECK: unset, the default; "sync", the synchronous
tags; "off", no tags) the step is recorded on CPU: 2 gloo ranks run the runtime's GPU path under
the stream-order model (fsdp_ext/diagnostics/stream_check.py) with a LaunchRecorder
(fsdp_ext/diagnostics/launch_trace.py), which records rank 0's third step: every op with its
stream, unit and size, every event and stream wait, every host sync. gpu_projection.py replays
each trace with GPU costs (the cost model and replay rules are stated there; figures from
fsdp_ext/planner/comm_model.py: H100) and reports the step time, the compute stream's idle gaps,
the exposed communication per unit and how far the host runs ahead of the GPU.

Model: transformers' LlamaForCausalLM, --layers decoder layers of hidden --hidden (16 heads,
MLP --ffn, vocabulary 32000, untied embeddings), one sequence of --seq tokens per rank; each
decoder layer sharded with fsdp_ext.fully_shard, then the root; AdamW (foreach, as on a GPU).
fp32 throughout: bf16 matmuls run at about 1 GFLOP/s on this CPU (no bf16 instructions),
against about 70 GFLOP/s in fp32, so a bf16 recording would not finish in minutes. The
projection therefore runs the matmuls at TF32 (half the bf16 peak) and moves fp32 bytes.

    python -m benchmarks.planner.project_gpu_step
    python -m benchmarks.planner.project_gpu_step --layers 2 --seq 256 --name gpu_projection_quick
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import fsdp_ext
from fsdp_ext import exit_without_finalization
from fsdp_ext.diagnostics import gpu_projection
from fsdp_ext.diagnostics.launch_trace import LaunchRecorder, LaunchTrace
from fsdp_ext.diagnostics.stream_check import stream_check
from fsdp_ext.planner.comm_model import H100, RING_FORMULAS
from fsdp_ext.env import CHECK as CHECK_ENV

from ..common import (RESULTS, command, init_rank, launch, machine, machine_line, markdown_table,
                      write_results)

# (FSDP_EXT_CHECK value or None for unset, the name in tables and the PNG)
MODES = [(None, "tags: default"), ("sync", "tags: sync"), ("off", "no tags (off)")]
STEPS = 3  # the recorded step is the last: the runtime knows the order from the first


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=16,
                         num_key_value_heads=16, max_position_embeddings=args.seq,
                         tie_word_embeddings=False, use_cache=False)  # training: no KV cache
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # every rank builds the same model before sharding
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fsdp_ext.fully_shard(layer)
    return fsdp_ext.fully_shard(model)


def worker(rank: int, world_size: int, port: int, mode: str | None, args, path: str) -> None:
    if mode is None:
        os.environ.pop(CHECK_ENV, None)
    else:
        os.environ[CHECK_ENV] = mode
    init_rank(rank, world_size, port, timeout_s=900)
    model = build(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    recorder = LaunchRecorder(iteration=STEPS)
    generator = torch.Generator().manual_seed(rank)
    seconds = []
    with stream_check(model=recorder):
        for _ in range(STEPS):
            tokens = torch.randint(0, 32000, (1, args.seq), generator=generator)
            start = time.perf_counter()
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seconds.append(time.perf_counter() - start)
        recorder.stop()
    if rank == 0:
        trace = recorder.trace()
        trace.meta.update(check=mode, cpu_step_s=seconds,
                          params=sum(p.numel() for p in model.parameters()))
        trace.save(path)
    dist.destroy_process_group()
    exit_without_finalization()


def record(mode: str | None, args) -> LaunchTrace:
    """One mode's recorded step (rank 0's)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        launch(worker, args.world_size, mode, args, path)
        return LaunchTrace.load(path)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}"


def report(traces: dict[str, LaunchTrace], costs, args, argv: list[str]) -> None:
    m = machine()
    cmd = command(__spec__.name, argv)
    projections = {name: gpu_projection.replay(t, costs) for name, t in traces.items()}
    summaries = {name: gpu_projection.summarize(p) for name, p in projections.items()}
    header = ["tags (FSDP_EXT_CHECK)", "step (ms)", "compute busy (ms)", "compute idle (ms)",
              "idle gaps", "largest gap (us)", "idle: after a host sync (ms)",
              "idle: host still launching (ms)", "idle: waiting for a collective (ms)",
              "exposed all-gather (ms)",
              "exposed reduce-scatter (ms)", "host run-ahead min / median (us)",
              "compute launches with the GPU waiting", "host syncs: runtime / all (blocking)",
              "host blocked (ms)"]
    rows = []
    for name, s in summaries.items():
        ag, rs = (s["comm"].get(k, dict(exposed=0.0)) for k in ("all_gather", "reduce_scatter"))
        rows.append([name, _ms(s["step_s"]), _ms(s["compute_busy_s"]), _ms(s["idle_s"]),
                     s["gaps"], _us(s["largest_gap_s"]), _ms(s["idle_sync_s"]),
                     _ms(s["idle_host_s"]), _ms(s["idle_comm_s"]), _ms(ag["exposed"]), _ms(rs["exposed"]),
                     f"{_us(s['run_ahead_min_s'])} / {_us(s['run_ahead_median_s'])}",
                     f"{s['starved_launches']} of {s['compute_kernels']}",
                     f"{s['runtime_host_syncs']} / {s['host_syncs']} ({s['host_blocking_syncs']})", _ms(s["host_blocked_s"])])
    before, after = summaries[MODES[1][1]], summaries[MODES[2][1]]
    compare = (f"Synchronous tags against no tags (PROJECTION): step {_ms(before['step_s'])} "
               f"against {_ms(after['step_s'])} ms ({before['step_s'] / after['step_s']:.2f}x), "
               f"compute idle {_ms(before['idle_s'])} against {_ms(after['idle_s'])} ms; with "
               f"the synchronous tags the host is blocked {_ms(before['host_blocked_s'])} ms in "
               f"{before['host_blocking_syncs']} syncs and the compute stream idles "
               f"{_ms(before['idle_sync_s'])} ms after them.")
    numbers = gpu_projection.unit_numbers(next(iter(traces.values())))
    unit_rows = []
    compute = next(iter(summaries.values()))["compute_units"]  # the same work in every mode
    for unit, n in numbers.items():
        row = [f"{n} = {unit or 'root'}", _ms(compute.get(unit, 0.0))]
        for s in summaries.values():
            for kind in ("all_gather", "reduce_scatter"):
                cell = s["units"].get(f"{unit}|{kind}")
                row.append(f"{_ms(cell['exposed'])} of {_ms(cell['seconds'])}" if cell else "-")
        unit_rows.append(row)
    unit_header = ["unit", "compute, forward + backward (ms)"] + [
        f"{name}: {kind}" for name in summaries for kind in ("AG", "RS")]
    first = next(iter(traces.values()))
    cpu = ", ".join(f"{name}: {min(t.meta['cpu_step_s']):.1f}-{max(t.meta['cpu_step_s']):.1f} s"
                    for name, t in traces.items())
    title = (f"one steady-state step of LlamaForCausalLM ({args.layers} layers, hidden "
             f"{args.hidden}, seq {args.seq}, fp32) recorded at world {args.world_size}, "
             f"modelled on {costs.world_size} x H100")
    png = os.path.join(args.out, f"{args.name}.png")
    text = "\n".join([
        f"### PROJECTION (modelled, not measured): {title}", "",
        f"`{cmd}`", "",
        f"Recorded on: {machine_line(m)}; gloo, {args.world_size} ranks, 1 thread each, under "
        f"the stream-order model; rank 0's step {STEPS} of {STEPS}; "
        f"{first.meta['params'] / 1e6:.1f}M parameters; CPU time per step (recording "
        f"included) {cpu}.", "",
        f"Cost model (assumed): {costs.describe()}.", "",
        "Every figure below is a PROJECTION: the recorded step replayed on that model "
        "(fsdp_ext/diagnostics/gpu_projection.py).", "",
        markdown_table(header, rows), "", compare, "",
        "Per unit, PROJECTION: its compute-stream kernel time, and its all-gathers (forward and "
        "backward) and reduce-scatter as ms exposed of ms in flight, tag exchanges included. "
        f"Optimizer step: {_ms(next(iter(summaries.values()))['optimizer_s'])} ms.", "",
        markdown_table(unit_header, unit_rows), "",
        f"![PROJECTION timeline]({os.path.basename(png)})", ""])
    print(text)
    cluster = vars(costs.cluster) | {"intra": vars(costs.cluster.intra),
                                     "inter": vars(costs.cluster.inter)}
    write_results(args.out, args.name, text, dict(
        label="PROJECTION, not measured", command=cmd, machine=m, args=vars(args),
        costs={k: v for k, v in vars(costs).items() if k not in ("cluster", "collective_s")}
        | {"cluster": cluster, "collectives": "ring (planner/comm_model.py: RING_FORMULAS)"},
        modes={name: dict(check=t.meta["check"], cpu_step_s=t.meta["cpu_step_s"],
                          records=len(t.records), summary=summaries[name])
               for name, t in traces.items()}))
    gpu_projection.draw(list(projections.values()), list(projections), png, title)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--world-size", type=int, default=2, help="ranks of the CPU recording")
    p.add_argument("--gpus", type=int, default=8, help="world size of the projection")
    p.add_argument("--traces", default=None, help="also keep each mode's trace (JSON) here")
    p.add_argument("--name", default="gpu_projection")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()
    traces = {}
    for mode, name in MODES:
        start = time.perf_counter()
        traces[name] = record(mode, args)
        print(f"{name}: recorded in {time.perf_counter() - start:.0f} s", flush=True)
        if args.traces:
            os.makedirs(args.traces, exist_ok=True)
            traces[name].save(os.path.join(args.traces, f"{args.name}_{mode or 'default'}.json"))
    report(traces, gpu_projection.CostModel(H100, RING_FORMULAS, world_size=args.gpus), args,
           sys.argv)


if __name__ == "__main__":
    main()
