"""Training-step benchmark: fsdp_ext vs torch DDP, FSDP1 and FSDP2 on the same model, side by side.

mp.spawn launches (gloo on CPU, NCCL on GPUs) run every framework on every rank. Each builds
the same model (same seed), wraps it and trains it with AdamW on the same batch.
  Phase 1 (memory): the frameworks one after the other, each in fresh processes (one launch each):
  peak RSS above the process's baseline (benchmarks/memory.py), the bytes of parameters, gradients
  and optimizer state, and for fsdp_ext its own `memory_report`.
  Phase 2 (time, default --timing interleaved): one launch with all frameworks alive on every
  rank, one step each in turn with barriers, in a rotating order, so changes in the load of a
  shared machine hit them alike (glibc's default allocator settings, as users run).
  --timing sequential times phase 1's runs instead (for models too large to co-exist).
A step's time is the slowest rank's; the report gives the median, fsdp_ext's time divided by each
peer's (the issue's targets are written that way) and each rank's CPU seconds per step.

    python -m benchmarks.step.bench_step                       # default case, world size 2
    python -m benchmarks.step.bench_step --world-size 4
    python -m benchmarks.step.bench_step --large --world-size 4 --timing sequential --steps 2 \\
        --warmup 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_ext import exit_without_finalization

from .. import memory
from ..common import RESULTS, command, init_rank, launch
from ..planner import validate_plan
from . import report
from .frameworks import (DEFAULT, FRAMEWORKS, LARGE, WRAPPERS, build_model, make_batch,
                         tensor_accounting, wrap)


class Trainer:
    """One framework's wrapped model, its AdamW and this rank's batch."""

    def __init__(self, name: str, cfg, device: torch.device, args):
        options = dict(forward_prefetch=args.prefetch, backward_prefetch=args.prefetch)
        self.name, self.device = name, device
        self.model = wrap(name, build_model(cfg, device), device, options)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x, self.y = make_batch(cfg, dist.get_rank(), device)

    def step(self) -> tuple[float, float, float]:
        """One training step after a barrier: (wall seconds, CPU seconds, loss)."""
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        self.opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        # CPU seconds of all this rank's threads (compute + gloo): what the step costs the cores,
        # less sensitive than wall time to other jobs on a shared machine.
        return time.perf_counter() - t0, time.process_time() - c0, loss.item()

    def accounting(self) -> dict:
        from fsdp_ext.diagnostics.memory import memory_report
        out = dict(tensors=tensor_accounting(self.model, self.opt))
        if self.name.startswith("fsdp_ext"):
            model = getattr(self.model, "_orig_mod", self.model)  # under torch.compile
            out["memory_report"] = memory_report(model, self.opt)
        return out


def _load_libraries(device: torch.device) -> None:
    """Import and initialise what every framework uses (autograd engine, AdamW, which imports
    torch._dynamo: ~110 MB of modules, the FSDP modules) before the baseline RSS is taken, so that
    library code is not billed to whichever framework happens to load it first."""
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import fsdp_ext  # noqa: F401
    layer = torch.nn.Linear(8, 8).to(device)
    opt = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(2, 8, device=device)).sum().backward()
    opt.step()
    dist.barrier()


def run_alone(name: str, cfg, device, args, timed_steps: int) -> dict:
    """Build and train one framework with nothing else alive: this rank's memory, then (outside
    the profiler that counts tensor bytes, which slows small ops) `timed_steps` timed steps."""
    _load_libraries(device)
    have_reset = memory.reset_peak()
    base = memory.current_bytes()
    with memory.TensorMemory(device) as tensors:
        trainer = Trainer(name, cfg, device, args)
        init_peak = memory.peak_bytes() - base
        memory.reset_peak()  # the training window starts here; the model stays
        with tensors.window():
            samples = [trainer.step() for _ in range(args.warmup + args.memory_steps)]
        train_peak = memory.peak_bytes() - base
    tensor_peak, tensor_init_peak = tensors.peak_bytes()
    samples = [trainer.step() for _ in range(timed_steps)] or samples[args.warmup:]
    out = dict(times=[s[0] for s in samples], cpu=[s[1] for s in samples], loss=samples[-1][2],
               base_rss=base, init_peak=init_peak, train_peak=train_peak,
               tensor_peak=tensor_peak, tensor_init_peak=tensor_init_peak,
               rss_reset=have_reset, **trainer.accounting())
    del trainer
    memory.release_free_memory()
    return out


def run_interleaved(names: list[str], cfg, device, args) -> dict[str, list]:
    """All frameworks alive at once, one step each in turn (rotating order): load changes on a
    shared machine hit every framework alike. Returns this rank's (wall, cpu, loss) per step."""
    trainers = {name: Trainer(name, cfg, device, args) for name in names}
    for trainer in trainers.values():
        for _ in range(args.warmup):
            trainer.step()
    samples: dict[str, list] = {name: [] for name in names}
    for i in range(args.steps):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(trainers[name].step())
    return samples


def _slowest(values: list[float]) -> list[float]:
    """Per step, the slowest rank's value (a step takes as long as its slowest rank)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _setup(rank: int, world_size: int, port: int, args):
    """Process group, device and model config of one rank."""
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(rank)
    init_rank(rank, world_size, port, threads=args.threads, timeout_s=1800,
              backend="nccl" if cuda else "gloo", RANK=str(rank), WORLD_SIZE=str(world_size),
              LOCAL_RANK=str(rank))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    cfg = LARGE if args.large else DEFAULT
    overrides = {k: v for k, v in (("batch", args.batch), ("n_layer", args.layers)) if v}
    cfg = type(cfg)(**{**cfg.as_dict(), **overrides})
    return device, cfg


def memory_worker(rank: int, world_size: int, port: int, args, name: str, path: str) -> None:
    """Phase 1, one framework in fresh processes: nothing another framework left behind (freed
    heap, one-time allocations) can lower or raise its peak."""
    memory.track_live_memory()
    device, cfg = _setup(rank, world_size, port, args)
    mine = run_alone(name, cfg, device, args, args.steps if args.timing == "sequential" else 0)
    ranks = [None] * world_size
    dist.all_gather_object(ranks, mine)
    times = _slowest(mine["times"])
    if rank == 0:
        torch.save(dict(ranks=ranks, alone_times=times, config=cfg.as_dict(),
                        cuda=device.type == "cuda"), path)
        print(f"alone {name}: median {statistics.median(times):.3f} s, tensor peak "
              f"{max(x['tensor_peak'] for x in ranks) / 2**20:.0f} MiB, RSS peak "
              f"+{max(x['train_peak'] for x in ranks) / 2**20:.0f} MiB", flush=True)
    dist.destroy_process_group()
    exit_without_finalization()


def _plan(device, cfg, args) -> dict | None:
    """The planner's prediction for fsdp_ext, made by every rank at once (as training runs)."""
    if args.no_plan or "fsdp_ext" not in args.frameworks:
        return None
    prediction = validate_plan.predict(cfg, device, args.threads, args.prefetch)
    if dist.get_rank() == 0:
        print(prediction["text"], flush=True)
    return prediction


def plan_worker(rank: int, world_size: int, port: int, args, path: str) -> None:
    """With --timing sequential: the prediction in a launch of its own, under the allocator
    setting of the memory launches whose step times it is compared with (every tensor above
    64 KiB mapped and unmapped on its own, see memory.track_live_memory: a step then pays page
    faults a default process does not, and so must the planner's compute measurement)."""
    memory.track_live_memory()
    device, cfg = _setup(rank, world_size, port, args)
    prediction = _plan(device, cfg, args)
    if rank == 0:
        torch.save(prediction, path)
    dist.destroy_process_group()
    exit_without_finalization()


def timing_worker(rank: int, world_size: int, port: int, args, path: str) -> None:
    """Phase 2: every framework alive in one process per rank, stepped in turn; the planner's
    prediction first, in the same processes, so that it sees the same machine load."""
    device, cfg = _setup(rank, world_size, port, args)
    prediction = _plan(device, cfg, args)
    samples = run_interleaved(args.frameworks, cfg, device, args)
    results = {"__plan__": prediction}
    for name, mine in samples.items():
        ranks = [None] * world_size
        dist.all_gather_object(ranks, mine)
        results[name] = dict(times=_slowest([s[0] for s in mine]),
                             cpu=[statistics.mean(c)
                                  for c in zip(*([s[1] for s in x] for x in ranks))],
                             interleaved_loss=statistics.mean(x[-1][2] for x in ranks))
        if rank == 0:
            print(f"interleaved {name}: median {statistics.median(results[name]['times']):.3f} s",
                  flush=True)
    if rank == 0:
        torch.save(results, path)
    dist.destroy_process_group()
    exit_without_finalization()


def run_all(args) -> dict:
    """Phase 1 per framework (fresh processes), then phase 2 (one launch); merged results."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.frameworks:
            path = os.path.join(tmp, f"{name}.pt")
            launch(memory_worker, args.world_size, args, name, path)
            results[name] = torch.load(path, weights_only=False)
        meta = results[args.frameworks[0]]
        if args.timing == "sequential":
            for r in results.values():
                r["times"] = r["alone_times"]
                r["cpu"] = [statistics.mean(c) for c in zip(*(x["cpu"] for x in r["ranks"]))]
            path = os.path.join(tmp, "plan.pt")
            launch(plan_worker, args.world_size, args, path)
            prediction = torch.load(path, weights_only=False)
        else:
            path = os.path.join(tmp, "timing.pt")
            launch(timing_worker, args.world_size, args, path)
            timing = torch.load(path, weights_only=False)
            prediction = timing.pop("__plan__")
            for name, r in timing.items():
                results[name].update(r)
    return dict(results=results, config=meta["config"], cuda=meta["cuda"], plan=prediction)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--large", action="store_true", help="16 blocks of d_model 1024 (201.6M params)")
    p.add_argument("--batch", type=int, default=0, help="sequences per rank (default: the case's)")
    p.add_argument("--layers", type=int, default=0, help="blocks (default: the case's)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per framework")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timing", choices=["interleaved", "sequential"], default="interleaved",
                   help="interleaved: all frameworks alive, one step each in turn (default); "
                        "sequential: time the memory phase's runs (for models too big to co-exist)")
    p.add_argument("--memory-steps", type=int, default=2,
                   help="steps of the memory phase (each framework alone, after --warmup)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--prefetch", type=int, default=1, help="fsdp_ext prefetch depth")
    p.add_argument("--frameworks", nargs="+", default=FRAMEWORKS, choices=list(WRAPPERS))
    p.add_argument("--no-plan", action="store_true", help="skip the planner's prediction")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even where GPUs exist")
    p.add_argument("--out", default=RESULTS, help="output directory")
    p.add_argument("--name", default="", help="file name stem (default: step_<case>_w<N>)")
    args = p.parse_args()
    case = "large" if args.large else "default"
    stem = args.name or f"step_{case}_w{args.world_size}"
    report.write(run_all(args), args, case, stem, command(__spec__.name))


if __name__ == "__main__":
    main()
