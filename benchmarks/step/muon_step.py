"""Muon on sharded parameters, per training step: what the optimizer step sends, what the
forward and backward send, the step time, the peak memory and how evenly the ranks share the
Newton-Schulz work, for

    (a) torch-distmuon     torch's FSDP2 + torchtitan's DistMuon
    (b) fsdp_ext-distmuon  fsdp_ext's fully_shard + DistMuon (the same optimizer, unchanged)
    (c) fsdp_ext-muon      fsdp_ext's fully_shard + fsdp_ext.optim.Muon

on a transformer (examples/models.py's GPT) and an MoE decoder (examples/moe.py). The Muon split
is torchtitan's Kimi recipe: attention projections per head (DistMuon's BlockShard(0, head_dim);
fsdp_ext's Muon `block_rows=head_dim`), routed-expert stacks per expert (Shard(0) keeps whole
experts), every other matrix whole (DistMuon's Owned; fsdp_ext's Muon: its owner exchange);
embeddings, norms and the head go to AdamW. DistMuon runs on CPU ranks through
tests/helpers/dist_muon_cpu.py (its streams and CUDA check answered, its math untouched).

Measured (gloo on CPU, fp32, one thread per rank):
  - optimizer-step bytes: what each rank sends to other ranks during the Muon step
    (all_to_all_single's split sizes; all-gathers' other ranks' pieces), the largest rank's;
  - forward/backward bytes: the all-gathers' gathered buffers and the reduce-scatters' inputs
    (padding included), counted where each FSDP issues them, per rank;
  - step time: every variant alive in one launch, one step each in turn (a rotating order, a
    barrier before each); a step's time is its slowest rank's, the figure the median;
  - peak RSS: each variant alone in fresh processes, above the process's baseline (the largest
    rank's);
  - Newton-Schulz balance: the flops of the orthogonalisations each rank ran, the largest over
    the mean (1.00: even), and the total over what one pass over every matrix costs (1.00: each
    matrix orthogonalised once).

    python -m benchmarks.step.muon_step                  # world 2 and 4, both models
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from fsdp_ext import exit_without_finalization

from .. import memory
from ..common import RESULTS, command, init_rank, launch, machine, machine_line, markdown_table
from ..common import write_results

VARIANTS = ("torch-distmuon", "fsdp_ext-distmuon", "fsdp_ext-muon")


# ---- the models and how Muon splits them ---------------------------------------------------------

def build(kind: str, args):
    """(model, its units in the order to shard them, head rows of its per-head matrices, a
    name -> 'head' | 'expert' | 'whole' | None (AdamW) rule)."""
    if kind == "gpt":
        from examples.models import GPT, GPTConfig
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=512, block_size=args.seq, n_layer=args.layers,
                              n_head=args.heads, d_model=args.dim))
        units = list(model.blocks)
        heads = (".attn.qkv.weight",)
    else:
        from examples.moe import MoEConfig, MoEDecoder
        cfg = MoEConfig(vocab_size=512, block_size=args.seq, dim=args.dim, n_heads=args.heads,
                        layer_experts=(0,) + (args.experts,) * (args.layers - 1), top_k=1,
                        hidden_dim=args.dim, dense_hidden_dim=4 * args.dim)
        model = MoEDecoder(cfg, seed=0)
        units = list(model.layers.values())
        heads = (".attention.wq.weight", ".attention.wk.weight", ".attention.wv.weight")

    def role(name: str, param) -> str | None:
        if not (name.startswith("blocks.") or name.startswith("layers.")) or param.ndim < 2:
            return None
        if name.endswith(heads):
            return "head"
        return "expert" if param.ndim == 3 else "whole"
    return model, units, args.dim // args.heads, role


def shard(model, units, impl: str, mesh):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_ext import fully_shard
    for unit in units:
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def optimizers(model, role, head_rows: int, muon: str, lr: float = 0.02):
    from torch.distributed.tensor import Shard
    named = {n: p for n, p in model.named_parameters()}
    roles = {n: role(n, p) for n, p in named.items()}
    matrices = [n for n, r in roles.items() if r is not None]
    adamw = torch.optim.AdamW([named[n] for n, r in roles.items() if r is None], lr=1e-3)
    if muon == "muon":
        import fsdp_ext
        groups = [{"params": [(n, named[n]) for n in matrices if roles[n] == "head"],
                   "block_rows": head_rows},
                  {"params": [(n, named[n]) for n in matrices if roles[n] != "head"]}]
        return fsdp_ext.optim.Muon([g for g in groups if g["params"]], lr=lr,
                                   adjust_lr_fn="match_rms_adamw"), adamw
    from torchtitan.distributed.flex_shard import BlockShard, BucketConfig, ComputeLayout, Owned
    from torchtitan.distributed.flex_shard import build_dist_muon
    layout = {"head": ComputeLayout({"dp_shard": BlockShard(0, head_rows)}),
              "expert": ComputeLayout({"dp_shard": Shard(0)}),
              "whole": ComputeLayout({"dp_shard": Owned()})}
    blocks = sorted({".".join(n.split(".")[:2]) for n in matrices})
    dist_muon = build_dist_muon(
        [{"params": [named[n] for n in matrices], "param_names": matrices}],
        compute_sharding_by_fqn={n: layout[roles[n]] for n in matrices},
        bucket_configs=[BucketConfig((f"{b}.*",), name=b) for b in blocks],
        lr=lr, adjust_lr_fn="match_rms_adamw")
    return dist_muon, adamw


# ---- what is counted -----------------------------------------------------------------------------

class Counts:
    """Bytes and Newton-Schulz flops of whichever (variant, phase) `current` names."""

    def __init__(self):
        self.current, self.bytes, self.flops = None, {}, {}

    def add(self, table: dict, n: float) -> None:
        if self.current is not None:
            table[self.current] = table.get(self.current, 0) + n

    def install(self) -> None:
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as torch_group
        from torchtitan.distributed.flex_shard import dist_muon

        import fsdp_ext.optim.newton_schulz as our_muon
        from fsdp_ext.runtime.comm import collectives as comm
        issue, reduce = comm.issue_all_gather, comm.reduce_scatter_groups
        torch_gather, torch_reduce = torch_group.foreach_all_gather, dist.reduce_scatter_single

        def counted_issue(fulls, *a, **k):
            self.add(self.bytes, sum(t.numel() * t.element_size() for t in fulls))
            return issue(fulls, *a, **k)

        def counted_reduce(flat, layout, *a, **k):
            sent = k.get("sent", a[2] if len(a) > 2 else None)
            groups = [g for i, g in enumerate(layout.groups) if sent is None or i in sent]
            self.add(self.bytes, layout.world_size * sum(g.shard_numel for g in groups)
                     * flat.element_size())
            return reduce(flat, layout, *a, **k)

        def counted_torch_gather(*a, **k):
            result = torch_gather(*a, **k)
            if result is not None:
                out = result.all_gather_output
                self.add(self.bytes, out.numel() * out.element_size())
            return result

        def counted_torch_reduce(output, input, *a, **k):
            self.add(self.bytes, input.numel() * input.element_size())
            return torch_reduce(output, input, *a, **k)

        comm.issue_all_gather, comm.reduce_scatter_groups = counted_issue, counted_reduce
        torch_group.foreach_all_gather = counted_torch_gather
        dist.reduce_scatter_single = counted_torch_reduce

        all_to_all = dist.all_to_all_single

        def counted_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None,
                               group=None, async_op=False):
            world = dist.get_world_size(group)
            me = dist.get_rank(group)
            splits = input_split_sizes or [input.numel() // world] * world
            self.add(self.bytes, (sum(splits) - splits[me]) * input.element_size())
            return all_to_all(output, input, output_split_sizes, input_split_sizes, group=group,
                              async_op=async_op)
        dist.all_to_all_single = counted_all_to_all

        def counted_ns(original):
            def ns(update, *a, **k):
                m, n = sorted(update.shape[-2:])
                batch = update.numel() // (m * n)
                steps = k.get("ns_steps", a[1] if len(a) > 1 else 5)
                self.add(self.flops, batch * steps * (4 * m * m * n + 2 * m ** 3))
                return original(update, *a, **k)
            return ns
        # fsdp_ext's Muon: torch's iteration per matrix, or its own batched one
        our_muon._zeropower_via_newtonschulz = counted_ns(our_muon._zeropower_via_newtonschulz)
        our_muon._newton_schulz_batch = counted_ns(our_muon._newton_schulz_batch)
        dist_muon._zeropower_via_newtonschulz = counted_ns(dist_muon._zeropower_via_newtonschulz)


class Trainer:
    def __init__(self, variant: str, kind: str, mesh, args):
        impl, muon = variant.split("-")
        self.variant = variant
        model, units, head_rows, role = build(kind, args)
        self.model = shard(model, units, impl, mesh)
        self.opts = optimizers(self.model, role, head_rows, muon)
        self.ones = sum(_ns_flops(p.shape, role(n, p), head_rows)
                        for n, p in self.model.named_parameters() if role(n, p))
        g = torch.Generator().manual_seed(1000 + dist.get_rank())
        self.x = torch.randint(0, 512, (args.batch, args.seq), generator=g)

    def step(self, counts: Counts | None = None) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if counts is not None:
            counts.current = (self.variant, "forward/backward")
        loss = self.model(self.x, self.x)
        loss.backward()
        if counts is not None:
            counts.current = (self.variant, "optimizer")
        for opt in self.opts:
            opt.step()
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        if counts is not None:
            counts.current = None
        return time.perf_counter() - t0


def _ns_flops(shape, role: str, head_rows: int, steps: int = 5) -> int:
    if role == "head":
        shape = (shape[0] // head_rows, head_rows, shape[1])
    m, n = sorted(shape[-2:])
    batch = 1 if len(shape) == 2 else shape[0]
    return batch * steps * (4 * m * m * n + 2 * m ** 3)


def _setup(rank, world, port):
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import dist_muon_cpu
    init_rank(rank, world, port, threads=1, timeout_s=1800)
    dist_muon_cpu.apply()
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))


def memory_worker(rank, world, port, args, kind, variant, path):
    memory.track_live_memory()
    mesh = _setup(rank, world, port)
    import fsdp_ext  # noqa: F401  (every variant's libraries loaded before the baseline)
    import torch.distributed.fsdp  # noqa: F401
    import torchtitan.distributed.flex_shard  # noqa: F401
    memory.save_largest_peak_and_exit(lambda: Trainer(variant, kind, mesh, args),
                                      args.warmup + 2, path)


def timing_worker(rank, world, port, args, kind, path):
    mesh = _setup(rank, world, port)
    counts = Counts()
    counts.install()
    trainers = {v: Trainer(v, kind, mesh, args) for v in VARIANTS}
    for t in trainers.values():
        for _ in range(args.warmup):
            t.step()
    times = {v: [] for v in VARIANTS}
    for i in range(args.steps):
        shift = i % len(VARIANTS)
        for v in VARIANTS[shift:] + VARIANTS[:shift]:
            times[v].append(trainers[v].step(counts))
    out = {}
    for v in VARIANTS:
        t = torch.tensor(times[v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        per_rank = torch.tensor([counts.bytes.get((v, "optimizer"), 0),
                                 counts.bytes.get((v, "forward/backward"), 0),
                                 counts.flops.get((v, "optimizer"), 0)], dtype=torch.float64)
        gathered = [torch.zeros_like(per_rank) for _ in range(world)]
        dist.all_gather(gathered, per_rank)
        table = torch.stack(gathered) / args.steps
        flops = table[:, 2]
        out[v] = dict(times=t.tolist(), optimizer_bytes=table[:, 0].max().item(),
                      fwd_bwd_bytes=table[:, 1].max().item(),
                      ns_balance=(flops.max() / flops.mean()).item() if flops.sum() else 1.0,
                      ns_repeats=flops.sum().item() / trainers[v].ones)
    if rank == 0:
        torch.save(out, path)
    dist.destroy_process_group()
    exit_without_finalization()


def run(args) -> dict:
    results = {}
    for kind in args.models:
        for world in args.world_sizes:
            with tempfile.TemporaryDirectory() as tmp:
                res = {}
                for v in VARIANTS:
                    path = os.path.join(tmp, f"{v}.pt")
                    launch(memory_worker, world, args, kind, v, path)
                    res[v] = dict(peak_rss=torch.load(path))
                path = os.path.join(tmp, "timing.pt")
                launch(timing_worker, world, args, kind, path)
                for v, r in torch.load(path).items():
                    res[v].update(r, median_s=statistics.median(r["times"]))
            results[f"{kind} w{world}"] = res
            print(f"{kind} world {world}: " + ", ".join(
                f"{v} {r['median_s'] * 1e3:.1f} ms" for v, r in res.items()), flush=True)
    return results


def report(results: dict, args, cmd: str) -> str:
    m = machine()
    lines = ["# Muon on sharded parameters: (a) torch FSDP2 + DistMuon, (b) fsdp_ext + DistMuon, "
             "(c) fsdp_ext + its Muon", "", f"`{cmd}`", "", machine_line(m),
             f"`uptime`: {m['uptime']}", "",
             f"Models: GPT (examples/models.py) and the MoE decoder (examples/moe.py, first block "
             f"dense, then {args.experts} routed experts per block), {args.layers} blocks, width "
             f"{args.dim}, {args.heads} heads, sequence {args.seq}, batch {args.batch} per rank; "
             f"fp32; {args.warmup} warm-up and {args.steps} timed steps per variant.", ""]
    rows = []
    for where, res in results.items():
        base = res["torch-distmuon"]
        for v, r in res.items():
            rows.append([where, v, f"{r['optimizer_bytes'] / 2**10:.1f}",
                         f"{r['fwd_bwd_bytes'] / 2**20:.3f}",
                         f"{r['fwd_bwd_bytes'] / base['fwd_bwd_bytes']:.3f}",
                         f"{r['median_s'] * 1e3:.1f}", f"{r['median_s'] / base['median_s']:.2f}",
                         f"{r['peak_rss'] / 2**20:.0f}", f"{r['ns_balance']:.2f}",
                         f"{r['ns_repeats']:.2f}"])
    lines.append(markdown_table(
        ["model, world", "variant", "optimizer step KiB sent (max rank)",
         "fwd/bwd MiB/step", "fwd/bwd vs (a)", "median step (ms)", "step vs (a)",
         "peak RSS (MiB)", "NS max/mean", "NS work / one pass"], rows))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--models", nargs="+", default=["gpt", "moe"], choices=["gpt", "moe"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=4, help="routed experts per MoE block")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=RESULTS, help="output directory")
    args = p.parse_args()
    cmd = command(__spec__.name)
    results = run(args)
    text = report(results, args, cmd)
    print(text)
    write_results(args.out, "muon_step", text, dict(command=cmd, machine=machine(),
                                                    results=results))


if __name__ == "__main__":
    main()
