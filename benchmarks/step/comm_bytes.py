"""Bytes each rank sends per training step, by collective, for fsdp_ext exact and each CommPolicy
setting, beside DDP's: the step benchmark's model (benchmarks/step/frameworks.py), one step after
a warm-up, counted at the runtime's collective entry points (the buffers it hands to gloo),
converted to what one rank sends on a ring: all-gather and all-to-all (W - 1) / W of the buffer,
all-reduce 2 (W - 1) / W (gloo's reduction here is an in-place all-reduce, runtime/comm/collectives.py). DDP's
line is computed, not counted: one all-reduce of every gradient in fp32.

    python -m benchmarks.step.comm_bytes [--world-size 2]
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ..common import RESULTS, command, init_rank, launch, machine, machine_line, markdown_table
from ..common import write_results
from .frameworks import DEFAULT, build_model, make_batch, wrap

VARIANTS = ["fsdp_ext", "fsdp_ext-int8w", "fsdp_ext-int8w-int8g", "fsdp_ext-fp8w-bf16g"]


class _Counter:
    """Patches the runtime's collective entry points; sums what one rank sends, by kind."""

    def __init__(self, world: int):
        self.world, self.sent = world, {}

    def _add(self, kind: str, buffer_bytes: float, factor: float) -> None:
        self.sent[kind] = self.sent.get(kind, 0.0) + factor * buffer_bytes

    def __enter__(self):
        from fsdp_ext.runtime.comm import collectives as comm
        w = self.world
        ring = (w - 1) / w
        self._saved = (comm.issue_all_gather, comm.all_gather_into, comm.reduce_scatter_groups,
                       comm.dist.all_to_all_single)

        def issue(fulls, sources, *args, **kwargs):
            self._add("all-gather", sum(t.numel() * t.element_size() for t in fulls), ring)
            return self._saved[0](fulls, sources, *args, **kwargs)

        def gather(output, input, *args, **kwargs):
            self._add("all-gather", output.numel() * output.element_size(), ring)
            return self._saved[1](output, input, *args, **kwargs)

        def reduce(flat, layout, group, async_op, sent=None):
            if group is not None:  # the groups sent (grads.groups_sent; None: all)
                numel = flat.numel() if sent is None else layout.world_size * sum(
                    layout.groups[i].shard_numel for i in sent)
                self._add("reduction", numel * flat.element_size(), 2 * ring)
            return self._saved[2](flat, layout, group, async_op, sent)

        def all_to_all(output, input, *args, **kwargs):
            self._add("reduction", input.numel() * input.element_size(), ring)
            return self._saved[3](output, input, *args, **kwargs)
        comm.issue_all_gather, comm.all_gather_into, comm.reduce_scatter_groups = (
            issue, gather, reduce)
        comm.dist.all_to_all_single = all_to_all  # (the quantized wire's reduction)
        return self

    def __exit__(self, *exc):
        from fsdp_ext.runtime.comm import collectives as comm
        (comm.issue_all_gather, comm.all_gather_into, comm.reduce_scatter_groups,
         comm.dist.all_to_all_single) = self._saved


def _worker(rank: int, world: int, port: int, out: dict) -> None:
    init_rank(rank, world, port)
    device = torch.device("cpu")
    x, y = make_batch(DEFAULT, rank, device)
    rows = {}
    for name in VARIANTS:
        model = wrap(name, build_model(DEFAULT, device), device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(2):  # the first step learns the order; the second is counted
            counter = _Counter(world)
            with counter if step else _Null():
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        rows[name] = counter.sent
    params = sum(p.numel() for p in build_model(DEFAULT, device).parameters())
    rows["ddp (computed)"] = {"reduction": 2 * (world - 1) / world * 4 * params}
    if rank == 0:
        out.update(rows)
    dist.destroy_process_group()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()
    import torch.multiprocessing as mp
    with mp.Manager() as manager:
        shared = manager.dict()
        launch(_worker, args.world_size, shared)
        rows = dict(shared)
    exact = sum(rows["fsdp_ext"].values())
    mib = 2**20
    table = [[name, f"{sent.get('all-gather', 0) / mib:.1f}", f"{sent.get('reduction', 0) / mib:.1f}",
              f"{sum(sent.values()) / mib:.1f}", f"{sum(sent.values()) / exact:.3f}"]
             for name, sent in rows.items()]
    text = (f"### Bytes each rank sends per step, world {args.world_size}\n\n"
            f"`{command(__spec__.name)}`\n\n{machine_line(machine())}\n\n"
            + markdown_table(["framework", "all-gathers (MiB)", "gradient reduction (MiB)",
                              "total (MiB)", "÷ fsdp_ext exact"], table) + "\n")
    print(text)
    write_results(args.out, f"comm_bytes_w{args.world_size}", text, {"rows": rows})


if __name__ == "__main__":
    main()
