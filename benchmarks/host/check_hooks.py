"""What the runtime's per-call guards cost on the host: forward+backward of a sharded model on one
gloo rank (nothing to gather over the wire, so the hooks' own time shows), in three variants built
side by side and timed in turn:

    full       as shipped: the unit hooks wrapped in torch.compiler.disable (so a compiled model
               leaves them out of its graphs) and a pre-hook on every submodule holding a unit's
               parameters (which names the module if it is called while they are sharded)
    no-checks  the submodule pre-hooks removed
    bare       also the unit hooks re-registered without the torch.compiler.disable wrapper

    python -m benchmarks.host.check_hooks [--layers 8] [--steps 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import fsdp_ext
from examples.models import GPT, GPTConfig
from fsdp_ext.runtime.core.registry import units_of

from ..common import free_port, init_rank, machine, machine_line


def build(layers: int, variant: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, d_model=32))
    for block in model.blocks:
        fsdp_ext.fully_shard(block)
    fsdp_ext.fully_shard(model)
    if variant == "plain-guards":
        for unit in units_of(model):
            holders = [h for h in unit._handles[2:]]
            modules = [m for m in unit.module.modules() if m is not unit.module and any(
                m is loc for b in unit.buckets for sl in b.slots for loc, _ in sl.locations)]
            for handle in holders:
                handle.remove()
            unit._handles = unit._handles[:2] + [
                m.register_forward_pre_hook(unit._check_params_gathered) for m in modules]
    elif variant != "full":
        for unit in units_of(model):
            keep = unit._handles[:2]
            for handle in unit._handles[2:]:  # the submodule guards
                handle.remove()
            unit._handles = keep
            if variant == "bare":
                for handle in keep:
                    handle.remove()
                unit._handles = [
                    unit.module.register_forward_pre_hook(unit._pre_forward, prepend=True,
                                                          with_kwargs=True),
                    unit.module.register_forward_hook(unit._post_forward, with_kwargs=True)]
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    init_rank(0, 1, free_port())
    variants = ["full", "plain-guards", "no-checks", "bare"]
    models = {v: build(args.layers, v) for v in variants}
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {v: [] for v in variants}
    for step in range(args.steps + 10):
        shift = step % len(variants)
        for v in variants[shift:] + variants[:shift]:  # rotate: drift hits all alike
            t0 = time.perf_counter()
            models[v](idx, idx).backward()
            if step >= 10:
                times[v].append(time.perf_counter() - t0)
    guards = sum(len(u._handles) - 2 for u in units_of(models["full"]))
    print(f"{args.layers} blocks + root, {guards} submodule guards; {args.steps} steps; "
          f"{machine_line(machine())}")
    print("| variant | median forward+backward (ms) | full ÷ this |")
    print("|---|---|---|")
    base = statistics.median(times["full"])
    for v in variants:
        median = statistics.median(times[v])
        print(f"| {v} | {median * 1e3:.3f} | {base / median:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
