"""What the planner measures on this machine before a launch: unit sizes, activations, compute,
the optimizer's speed and (inside a process group) the all-gather link.

Everything runs on the unwrapped model; nothing here shards. `measure_link` and
`measure_contention` communicate and need an initialised process group (every rank calls them),
as does `measure_compute(..., together=True)`.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.comm.collectives import all_gather_into
from ..runtime.core.registry import units_of
from .comm_model import Link, fit_link


@dataclass
class UnitSpec:
    """One future unit: the shapes of the parameters it will own, and how it lays them out."""

    name: str
    module: nn.Module | None
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    itemsize: int = 4
    is_root: bool = False
    activation_bytes: int = 0     # saved for backward by this unit's own forward (measured)
    layout: str = "rows"          # fully_shard's; "flat" for FullyShardedDataParallel's units

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.numels)


def describe_units(model: nn.Module, unit_classes=None) -> list[UnitSpec]:
    """The units fully_shard would create: existing fsdp_ext units if the model is sharded, else
    one per module whose class is in `unit_classes` (outermost only), and the root."""
    existing = units_of(model)
    if existing:
        return [UnitSpec(u.name or "<root>", u.module,
                         [tuple(s.shape) for b in u.buckets for s in b.slots],
                         u.buckets[0].dtype.itemsize if u.buckets else 4, u.module is model,
                         layout=u.buckets[0].layout.kind if u.buckets else "rows")
                for u in existing]
    classes = tuple(unit_classes or ())
    picked: dict[int, str] = {}
    for name, module in model.named_modules():
        if name and isinstance(module, classes) and not any(
                name.startswith(p + ".") for p in picked.values()):
            picked[id(module)] = name
    owned: set[int] = set()
    specs = []
    for name, module in model.named_modules():
        if id(module) in picked:
            params = [p for p in module.parameters() if id(p) not in owned]
            owned.update(id(p) for p in params)
            specs.append(UnitSpec(name, module, [tuple(p.shape) for p in params],
                                  params[0].element_size() if params else 4))
    rest = [p for p in model.parameters() if id(p) not in owned]
    specs.insert(0, UnitSpec("<root>", model, [tuple(p.shape) for p in rest],
                             rest[0].element_size() if rest else 4, is_root=True))
    return specs


def measure_activations(model: nn.Module, specs: list[UnitSpec], run_forward) -> int:
    """Bytes autograd saves for backward in one forward (distinct storages, parameters excluded),
    attributed to the innermost unit running at the time; returns the total."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[UnitSpec] = [s for s in specs if s.is_root][:1]
    seen: dict[int, tuple[UnitSpec, int]] = {}
    handles = []

    def enter(spec):
        return lambda module, args: stack.append(spec)  # returns None: args unchanged

    def leave(module, args, output):
        stack.pop()  # returns None: output unchanged

    for spec in specs:
        if not spec.is_root and spec.module is not None:
            handles.append(spec.module.register_forward_pre_hook(enter(spec)))
            handles.append(spec.module.register_forward_hook(leave))

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (stack[-1], storage.nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run_forward()
    finally:
        for h in handles:
            h.remove()
    for spec in specs:
        spec.activation_bytes = 0
    for spec, nbytes in seen.values():
        spec.activation_bytes += nbytes
    return sum(nbytes for _, nbytes in seen.values())


def _timed(fn, synced: bool) -> float:
    if synced:
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _slowest(seconds: float) -> float:
    """The slowest rank's value (a step lasts as long as that rank's); every rank calls this."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure_compute(run_step, reps: int = 3, warmup: int = 2, together: bool = False) -> float:
    """Median seconds of forward + backward (`run_step`), after `warmup` calls (the first ones
    pay one-time costs: lazy initialisation, first-touch page faults). `together`: every rank of
    the process group calls this, each repetition starts on all of them at once as training steps
    do (ranks that share cores are measured competing for them), and the slowest rank's median
    counts."""
    for _ in range(warmup):
        run_step()
    median = statistics.median(_timed(run_step, together) for _ in range(reps))
    return _slowest(median) if together else median


def measure_contention(run_step, unit_numel: int, probe_s: float, reps: int = 3) -> float:
    """How much of the communication time still adds to a step when it runs during compute.

    On CPU ranks that fill the cores, gloo's threads copy every byte through the cores the
    compute uses, so issuing a collective early does not hide it. Every rank calls this: a probe
    of all-gathers of unit-sized fp32 buffers, about `probe_s` long by itself, is timed alone
    (t_comm), one forward + backward alone (t_compute), and the probe issued asynchronously just
    before one forward + backward (t_both), repetition by repetition. Returns
    (t_both - t_compute) / t_comm, at least 0: 0 when communication hides completely, 1 when it
    adds its own time, more when it also slows the compute."""
    world, rank = dist.get_world_size(), dist.get_rank()
    chunk = max(unit_numel // world, 1)
    out = torch.empty(chunk * world)
    slot = out.narrow(0, rank * chunk, chunk)
    one = _slowest(statistics.median(
        _timed(lambda: all_gather_into(out, slot, None, async_op=False), True) for _ in range(3)))
    count = int(min(max(round(probe_s / max(one, 1e-6)), 1), 64))

    def comm_alone():
        for work in [all_gather_into(out, slot, None, async_op=True) for _ in range(count)]:
            work.wait()

    def both():
        works = [all_gather_into(out, slot, None, async_op=True) for _ in range(count)]
        run_step()
        for work in works:
            work.wait()

    comm_alone()
    samples = [[_timed(fn, True) for fn in (comm_alone, run_step, both)] for _ in range(reps)]
    t_comm, t_compute, t_both = (_slowest(statistics.median(column)) for column in zip(*samples))
    return max(0.0, (t_both - t_compute) / max(t_comm, 1e-9))


def adamw_seconds_per_element(numel: int = 1 << 21, reps: int = 3) -> float:
    """AdamW step time per parameter element on this machine (single-tensor, as on CPU)."""
    p = nn.Parameter(torch.zeros(numel))
    p.grad = torch.ones(numel)
    opt = torch.optim.AdamW([p], lr=1e-4)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(reps):
        opt.step()
    return (time.perf_counter() - t0) / reps / numel


def copy_bytes_per_second(numel: int = 1 << 23, reps: int = 5) -> float:
    """Bytes per second of a large fp32 copy_ on this machine (read + write counted once each)."""
    src, dst = torch.randn(numel), torch.empty(numel)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return 2 * numel * 4 * reps / (time.perf_counter() - t0)


def measure_link(group=None, sizes=(1 << 16, 1 << 20, 1 << 23), reps: int = 5) -> Link:
    """Fit alpha and bandwidth to the runtime's all-gathers of fp32 buffers over `group` (every
    rank of it calls this). A fresh process group's first collectives set up its connections and
    buffers, so a few large ones run first, untimed."""
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    numel = max(sizes) // 4 // world * world
    out = torch.empty(numel)
    for _ in range(3):
        all_gather_into(out, out.narrow(0, rank * (numel // world), numel // world), group,
                        async_op=False)
    samples = []
    for full_bytes in sizes:
        numel = full_bytes // 4 // world * world
        out = torch.empty(numel)
        slot = out.narrow(0, rank * (numel // world), numel // world)
        all_gather_into(out, slot, group, async_op=False)  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            all_gather_into(out, slot, group, async_op=False)
            times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        samples.append((numel * 4, t.item()))
    return fit_link(samples, world, f"{dist.get_backend(group)} (measured, {world} ranks)")
