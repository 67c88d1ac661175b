"""MoE training step: fsdp_ext vs torch's FSDP2 on the example MoE decoder (examples/moe.py),
sharded as torchtitan 0.3.0's apply_fsdp_to_decoder shards it at EP=1 (examples/train.py's
shard_moe): the embedding, [norm, lm_head] as one unit kept gathered, each block, the root; a
block's routed experts ([E, in, out]) Shard(1) where the ranks outnumber the experts, else
Shard(0). Where torchtitan's rule picks Shard(1), the "-shard0" variants shard the experts along
dim 0 anyway, to show what that costs: E experts on W > E ranks leave W - E ranks holding a
padding row of each expert weight, and every all-gather moves it. The "-ep2" variants (at world
sizes above and divisible by --ep, default 2, with experts it divides) add expert parallelism
(examples/moe_ep.py) as torchtitan lays it out: an (efsdp, ep) mesh, each rank holding experts /
ep of every MoE block's experts and sending tokens to them by all-to-all, the experts sharded by
FSDP over efsdp (torchtitan's placement rule over efsdp x ep ranks), everything else over the
world; each unit divides its gradient sums by the world size (torch's FSDP2 with sums forced, as
gloo has no PREMUL_SUM).

Per variant, at each world size (gloo on CPU, one thread per rank, fp32, AdamW):
  - peak RSS: each variant alone in fresh processes, the peak above the process's baseline over
    the warm-up and timed steps (benchmarks/memory.py), the largest rank's;
  - step time: every variant alive in one launch, one step each in turn (a rotating order, a
    barrier before each), so that a shared machine's load hits them alike; a step's time is its
    slowest rank's, the figure the median of the timed steps;
  - all-gather bytes per step: the gathered (output) buffers of every all-gather in a timed step,
    counted at the runtime's entry points (fsdp_ext: runtime.comm.issue_all_gather /
    all_gather_into; torch: dist.all_gather_single, which its FSDP2 calls), in total and of the
    MoE blocks' units; the routed experts' share of those is computed from their shapes and
    placement (W x the largest chunk along the shard dim), and the script checks that the
    measured Shard(0) - Shard(1) difference is exactly the computed padding, and EP's saving
    over EP=1 exactly the computed expert bytes;
  - all-to-all bytes per step (EP): what each rank receives through all_to_all_single (token
    rows and their gradients, and the per-expert counts; the rows a rank keeps for its own
    experts included, though they never leave it), the largest rank's.

    python -m benchmarks.step.moe_step                    # world 2 and 4, 2 experts per MoE block
    python -m benchmarks.step.moe_step --world-sizes 4 --steps 12

EP=2 beside EP=1 alone: --world-sizes 4 --variants fsdp_ext torch fsdp_ext-ep2 torch-ep2.
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
from .moe_sharding import MoEConfig, MoEDecoder, ep_of, expert_dim, expert_gather_bytes, shard
from .moe_sharding import variants


def config(args) -> MoEConfig:
    return MoEConfig(vocab_size=256, block_size=args.seq, dim=args.dim, n_heads=4,
                     layer_experts=(0,) + (args.experts,) * args.moe_blocks, top_k=1,
                     hidden_dim=args.hidden, dense_hidden_dim=4 * args.dim)


class Bytes:
    """Gathered bytes by unit ("layers.1", ...; "" for the root) of whichever variant `current`
    names, and the bytes all_to_all_single received (`a2a`, this rank's)."""

    def __init__(self):
        self.current, self.by, self.a2a = None, {}, {}

    def add(self, unit: str, n: int) -> None:
        if self.current is not None:
            per = self.by.setdefault(self.current, {})
            per[unit] = per.get(unit, 0) + n

    def install(self) -> None:
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as torch_group
        from fsdp_ext.runtime.comm import collectives as comm
        issue, gather = comm.issue_all_gather, comm.all_gather_into
        torch_gather = torch_group.foreach_all_gather

        def counted_issue(fulls, sources, slot, group, label, *a, **k):
            # label: "all_gather of unit 'layers.1'"
            self.add(label.split("'")[1] if "'" in label else label,
                     sum(t.numel() * t.element_size() for t in fulls))
            return issue(fulls, sources, slot, group, label, *a, **k)

        def counted_gather(output, input, *a, **k):   # (the path without the issue thread)
            self.add("(unlabelled)", output.numel() * output.element_size())
            return gather(output, input, *a, **k)

        def counted_torch(fsdp_params, *a, **k):
            result = torch_gather(fsdp_params, *a, **k)
            fqn = fsdp_params[0]._param_fqn or ""
            unit = ".".join(fqn.split(".")[:2]) if fqn.startswith("layers.") else fqn
            if result is not None:
                out = result.all_gather_output
                self.add(unit, out.numel() * out.element_size())
            return result
        comm.issue_all_gather, comm.all_gather_into = counted_issue, counted_gather
        torch_group.foreach_all_gather = counted_torch
        all_to_all = dist.all_to_all_single

        def counted_all_to_all(output, *a, **k):   # examples/moe_ep.py's dispatch and combine
            if self.current is not None:
                n = output.numel() * output.element_size()
                self.a2a[self.current] = self.a2a.get(self.current, 0) + n
            return all_to_all(output, *a, **k)
        dist.all_to_all_single = counted_all_to_all


class Trainer:
    def __init__(self, name: str, cfg: MoEConfig, mesh, args):
        self.name = name
        self.model = shard(MoEDecoder(cfg, seed=0), name, mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1000 + dist.get_rank())
        data = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=g)
        self.x, self.y = data[:, :-1], data[:, 1:]

    def step(self) -> tuple[float, float]:
        dist.barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(self.x, self.y)
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t0, loss.item()


def _setup(rank, world, port, args):
    from torch.distributed.device_mesh import init_device_mesh
    init_rank(rank, world, port, threads=1, timeout_s=1800)
    return config(args), init_device_mesh("cpu", (world,))


def memory_worker(rank, world, port, args, name, path):
    memory.track_live_memory()
    cfg, mesh = _setup(rank, world, port, args)
    import fsdp_ext  # noqa: F401  (both variants' libraries loaded before the baseline)
    import torch.distributed.fsdp  # noqa: F401
    memory.save_largest_peak_and_exit(lambda: Trainer(name, cfg, mesh, args), args.warmup + 2,
                                      path)


def timing_worker(rank, world, port, args, names, path):
    cfg, mesh = _setup(rank, world, port, args)
    counter = Bytes()
    counter.install()
    trainers = {n: Trainer(n, cfg, mesh, args) for n in names}
    for t in trainers.values():
        for _ in range(args.warmup):
            t.step()
    times = {n: [] for n in names}
    losses = {}
    for i in range(args.steps):
        shift = i % len(names)
        for n in names[shift:] + names[:shift]:
            counter.current = n
            seconds, losses[n] = trainers[n].step()
            counter.current = None
            times[n].append(seconds)
    slowest, a2a = {}, {}
    for n in names:
        t = torch.tensor(times[n], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[n] = t.tolist()
        received = torch.tensor(float(counter.a2a.get(n, 0)), dtype=torch.float64)
        dist.all_reduce(received, op=dist.ReduceOp.MAX)  # ranks receive different token counts
        a2a[n] = received.item() / args.steps
    if rank == 0:
        by = {n: {k: v / args.steps for k, v in counter.by.get(n, {}).items()} for n in names}
        torch.save(dict(times=slowest, bytes=by, a2a=a2a, losses=losses), path)
    dist.destroy_process_group()
    exit_without_finalization()


def moe_unit_bytes(per_unit: dict, cfg: MoEConfig) -> float:
    """Gathered bytes per step of the MoE blocks' units."""
    return sum(per_unit.get(f"layers.{i}", 0) for i, e in enumerate(cfg.layer_experts) if e)


def run(args) -> dict:
    cfg = config(args)
    out = {}
    for world in args.world_sizes:
        names = [n for n in variants(world, args.experts, args.ep)
                 if not args.variants or n in args.variants]
        res = {n: {} for n in names}
        with tempfile.TemporaryDirectory() as tmp:
            for n in names:
                path = os.path.join(tmp, f"{n}.pt")
                launch(memory_worker, world, args, n, path)
                res[n]["peak_rss"] = torch.load(path)
            path = os.path.join(tmp, "timing.pt")
            launch(timing_worker, world, args, names, path)
            timing = torch.load(path)
        moe_blocks = args.moe_blocks
        for n in names:
            dim, ep = expert_dim(n, world, args.experts), ep_of(n)
            per_label = timing["bytes"][n]
            gathers_per_block = 2  # forward, and again in backward (blocks reshard after forward)
            res[n].update(
                median_s=statistics.median(timing["times"][n]), times=timing["times"][n],
                loss=timing["losses"][n], expert_dim=dim, ep=ep,
                gather_bytes=sum(per_label.values()), a2a_bytes=timing["a2a"][n],
                moe_unit_bytes=moe_unit_bytes(per_label, cfg),
                expert_bytes=gathers_per_block * moe_blocks * expert_gather_bytes(cfg, dim, world,
                                                                                  ep))
        for impl in ("fsdp_ext", "torch"):  # the measured differences are the computed ones
            for other in (f"{impl}-shard0", f"{impl}-ep{args.ep}"):
                if impl in res and other in res:
                    measured = res[other]["gather_bytes"] - res[impl]["gather_bytes"]
                    computed = res[other]["expert_bytes"] - res[impl]["expert_bytes"]
                    assert measured == computed, (other, world, measured, computed)
        out[world] = res
        print(f"world {world}: " + ", ".join(
            f"{n} {r['median_s'] * 1e3:.1f} ms" for n, r in res.items()), flush=True)
    return out


def report(results: dict, args, cmd: str) -> str:
    m = machine()
    cfg = config(args)
    lines = ["# MoE step: fsdp_ext vs torch FSDP2 (examples/moe.py, EP=1 and EP)", "",
             f"`{cmd}`", "", machine_line(m), f"`uptime`: {m['uptime']}", "",
             f"Model: dim {cfg.dim}, blocks {cfg.layer_experts} (0 = dense, n = MoE of n experts), "
             f"top-1, experts' hidden {cfg.hidden_dim}, sequence {cfg.block_size}, batch "
             f"{args.batch} per rank; fp32, AdamW; {args.warmup} warm-up and {args.steps} timed "
             "steps per variant.", ""]
    rows = []
    for world, res in results.items():
        for n, r in res.items():
            where = f" over efsdp ({world // r['ep']} ranks)" if r["ep"] > 1 else ""
            rows.append([world, n, f"Shard({r['expert_dim']}){where}",
                         f"{r['median_s'] * 1e3:.1f}", f"{r['peak_rss'] / 2**20:.0f}",
                         f"{r['gather_bytes'] / 2**20:.2f}", f"{r['moe_unit_bytes'] / 2**20:.2f}",
                         f"{r['expert_bytes'] / 2**20:.2f}", f"{r['a2a_bytes'] / 2**20:.2f}"])
    lines.append(markdown_table(
        ["world", "variant", "experts", "median step (ms)", "peak RSS (MiB)",
         "all-gather MiB/step", "MoE blocks' MiB/step", "experts' MiB/step",
         "all-to-all MiB/step (received)"], rows))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--experts", type=int, default=2, help="routed experts per MoE block")
    p.add_argument("--moe-blocks", type=int, default=2, help="MoE blocks after one dense block")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512, help="each expert's hidden width")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ep", type=int, default=2,
                   help="expert-parallel degree of the -ep variants (1: none)")
    p.add_argument("--variants", nargs="+",
                   help="run only these variants (default: all that apply at each world size)")
    p.add_argument("--out", default=RESULTS, help="output directory")
    args = p.parse_args()
    cmd = command(__spec__.name)
    results = run(args)
    text = report(results, args, cmd)
    print(text)
    write_results(args.out, "moe_step", text, dict(command=cmd, machine=machine(),
                                                   results={str(k): v for k, v in results.items()}))


if __name__ == "__main__":
    main()
