"""Start-up from a pretrained safetensors checkpoint: fsdp_ext.load_pretrained against torch FSDP2's
flow, on a GPT of --layers blocks of --d-model (559M parameters by default) at --world-size ranks.

    torch    meta-device model, torch's fully_shard per block and root, to_empty; rank 0 reads the
             whole file (safetensors.torch.load_file), then set_model_state_dict(...,
             full_state_dict=True, broadcast_from_rank0=True) sends every tensor to the others
    fsdp_ext meta-device model, fsdp_ext.fully_shard per block and root, to_empty, then
             fsdp_ext.load_pretrained(model, file): each rank reads its rows from the memory map

Each flow runs in fresh processes; per rank: the wall time of the load (from after to_empty to the
end, barrier included) and the peak RSS above the RSS at that point (VmHWM after clear_refs: the
shard's pages, first touched by the load, plus whatever the flow reads or buffers; file pages
mapped by safetensors count too). The checkpoint file is written once (fp32, the head tied to the
embedding as Hugging Face saves it) and is in the page cache for both flows (a warm start).
Both loads are checked against the file: every rank's parameters equal its rows of the checkpoint.

    .venv/bin/python -m benchmarks.startup.pretrained_load --world-size 4
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist

from examples.models import GPT, GPTConfig

from .. import memory
from ..common import init_rank, launch, machine, machine_line


def config(args) -> GPTConfig:
    return GPTConfig(vocab_size=32000, block_size=128, n_layer=args.layers, n_head=12,
                     d_model=args.d_model)


def write_checkpoint(args, path: str) -> int:
    from safetensors.torch import save_file
    torch.manual_seed(0)
    model = GPT(config(args))
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, path)
    return sum(v.numel() for v in state.values())


def worker(rank: int, world: int, port: int, args, flow: str, path: str, out: str) -> None:
    init_rank(rank, world, port, timeout_s=1800, RANK=str(rank), WORLD_SIZE=str(world))
    from safetensors import safe_open
    with torch.device("meta"):
        model = GPT(config(args))
    if flow == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_ext import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    dist.barrier()
    memory.release_free_memory()
    memory.reset_peak()
    base = memory.current_bytes()
    start = time.perf_counter()
    if flow == "torch":
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_model_state_dict)
        full = load_file(path) if rank == 0 else {}
        set_model_state_dict(model, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=False))
        del full
    else:
        import fsdp_ext
        fsdp_ext.load_pretrained(model, path)
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = memory.peak_bytes() - base
    with safe_open(path, framework="pt") as f:  # the load is right: this rank's rows match
        for name, param in model.named_parameters():
            local = param.to_local()
            if local.numel():  # Shard(0): torch.chunk's rows
                rows = torch.chunk(torch.arange(param.shape[0]), world)[rank]
                expected = f.get_slice(name)[int(rows[0]):int(rows[-1]) + 1]
                assert torch.equal(local, expected), (flow, name)
    result = dict(rank=rank, seconds=seconds, peak_rss=peak,
                  shard_bytes=sum(p.to_local().numel() * 4 for p in model.parameters()))
    with open(os.path.join(out, f"{flow}-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--d-model", type=int, default=1536)
    parser.add_argument("--dir", default="/tmp/fsdp_ext_pretrained_bench")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"gpt-{args.layers}x{args.d_model}.safetensors")
    if not os.path.exists(path):
        write_checkpoint(args, path)
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    results = {}
    for flow in ("torch", "fsdp_ext", "torch", "fsdp_ext"):  # twice each, alternating
        launch(worker, args.world_size, args, flow, path, args.dir)
        runs = [json.load(open(os.path.join(args.dir, f"{flow}-{r}.json")))
                for r in range(args.world_size)]
        results.setdefault(flow, []).append(runs)
    print(f"{numel / 1e6:.1f}M parameters ({os.path.getsize(path) / 2**30:.2f} GiB fp32 file), "
          f"world {args.world_size}; {machine_line(machine())}")
    print("| flow | run | load wall time (s, slowest rank) | peak RSS above start, rank 0 (MiB) "
          "| peak RSS above start, max of other ranks (MiB) | shard per rank (MiB) |")
    print("|---|---|---|---|---|---|")
    for flow, runs in results.items():
        for i, ranks in enumerate(runs):
            print(f"| {flow} | {i + 1} | {max(r['seconds'] for r in ranks):.2f} | "
                  f"{ranks[0]['peak_rss'] / 2**20:.0f} | "
                  f"{max(r['peak_rss'] for r in ranks[1:]) / 2**20:.0f} | "
                  f"{ranks[0]['shard_bytes'] / 2**20:.0f} |")


if __name__ == "__main__":
    main()
