"""The planner's model: per-rank peak memory and step time of one fsdp_ext setting (plan.py
gathers the inputs and calls it for every setting).

Memory per rank (bytes): sharded parameters, gradients and optimizer state (AdamW: two fp32
tensors per parameter), activations (measured: what autograd saves for backward in one forward of
`loss_fn`, or `activation_bytes`), gathered units in flight (the root plus depth + 1 units under
FULL_SHARD; every unit under SHARD_GRAD_OP) and the gradient path's buffers (a unit's gradients
and its packed copy, plus the pending reduce-scatters' packed copies). The peak is the largest of:
the end of forward, each unit's backward and post-backward (activations freed and gradient shards
created as backward goes), the optimizer step.

Step time: measured forward + backward of `loss_fn` on this machine (or flops / flop rate), the
optimizer on the local shard, and the communication of an alpha-beta ring model (comm_model.py).
How much communication hides behind compute (prefetch depth >= 1): the first all-gather and the
last reduction never do; of the rest, per unit max(0, comm - compute), except on CPU ranks that
fill every core, where gloo's threads copy through the cores the compute uses: there the rest
costs `contention` times its own time, a share measured on the machine by
measure.measure_contention (1 when it cannot be measured). Depth 0 exposes everything.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..runtime.bucket.layout import flat_layout, rows_layout
from ..runtime.bucket.param_buckets import DIRECT_MIN_NUMEL
from ..runtime.unit.schedule_options import ScheduleOptions
from .comm_model import Link, all_gather_s, all_reduce_s, reduce_scatter_s
from .measure import UnitSpec

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
MAX_PENDING_REDUCE_SCATTERS = ScheduleOptions().max_pending_reduce_scatters


@dataclass(frozen=True)
class Setting:
    strategy: str
    prefetch: int


@dataclass
class Estimate:
    setting: Setting
    memory: dict = field(default_factory=dict)   # bytes per rank, by component, and "peak"
    time: dict = field(default_factory=dict)     # seconds per step, by component, and "step"
    fits: bool | None = None


def padded_numel(spec: UnitSpec, shards: int) -> int:
    """What a unit gathers, padding included, as the runtime lays it out (runtime/bucket/layout.py):
    `shards` times each rank's shard. (One bucket: the planner assumes one dtype per unit.)"""
    if spec.layout == "flat":
        return flat_layout(spec.shapes, shards, 0).full_numel
    shapes = [s if len(s) else (1,) for s in spec.shapes]
    return shards * rows_layout(shapes, shards, 0, DIRECT_MIN_NUMEL).shard_numel


@dataclass
class PlanInputs:
    """Inputs of the estimate: the units and what was measured or given."""

    units: list[UnitSpec]
    world_size: int
    compute_s: float                 # forward + backward per rank
    adamw_s_per_element: float
    link: Link                       # the shard group's link
    cross_link: Link | None = None   # HYBRID_SHARD / NO_SHARD replicas across nodes
    per_node: int = 0                # ranks per node (HYBRID_SHARD shard group)
    param_bytes: int = 4             # gathered parameter dtype size (param_dtype)
    reduce_bytes: int = 4            # gradient reduction dtype size
    state_bytes: int = 4             # sharded parameter / gradient dtype size
    optimizer_states: int = 2        # AdamW: exp_avg, exp_avg_sq (fp32)
    reduce_is_all_reduce: bool = False  # gloo: the runtime all-reduces in place
    comm_hides: bool = True          # False where communication competes for the compute cores
    contention: float = 1.0          # then: share of overlapped communication that still adds
    copy_bytes_per_s: float = 0.0    # CPU: the copies around each collective cost compute time
    grads_set_to_none: bool = True   # zero_grad(set_to_none=True): gradient shards freed
    # A CommPolicy (runtime/wire/comm_policy.py): bytes per element on the wire (0: as computed in),
    # and the quantize / dequantize passes' cost per byte they read and write (0: none)
    wire_param_bytes: float = 0.0
    wire_reduce_bytes: float = 0.0
    quant_s_per_byte: float = 0.0

    def shards(self, strategy: str) -> int:
        if strategy == "NO_SHARD":
            return 1
        if strategy == "HYBRID_SHARD" and self.per_node:
            return min(self.per_node, self.world_size)
        return self.world_size


def estimate_memory(m: PlanInputs, s: Setting) -> dict:
    shards = m.shards(s.strategy)
    blocks = [u for u in m.units if not u.is_root]
    root = next((u for u in m.units if u.is_root), None)
    local = {id(u): padded_numel(u, shards) // shards for u in m.units}
    full = {id(u): padded_numel(u, shards) for u in m.units}
    params = sum(local.values()) * m.state_bytes
    optimizer = sum(u.numel for u in m.units) // shards * 4 * m.optimizer_states + 4 * sum(
        len(u.numels) for u in m.units)
    biggest = max((full[id(u)] for u in blocks), default=0) * m.param_bytes
    root_full = full[id(root)] * m.param_bytes if root else 0
    freed_between_uses = s.strategy in ("FULL_SHARD", "HYBRID_SHARD")
    if freed_between_uses:
        gathered = root_full + min(s.prefetch + 1, len(blocks)) * biggest
    else:  # kept gathered from forward to backward
        gathered = sum(full.values()) * m.param_bytes
    activations = sum(u.activation_bytes for u in m.units)
    static = params + optimizer
    grads_all = params
    pending = MAX_PENDING_REDUCE_SCATTERS
    phases = {"end of forward": static + gathered + activations
              + (0 if m.grads_set_to_none else grads_all)}
    order = list(reversed(blocks))  # backward order
    remaining = activations - (root.activation_bytes if root else 0)
    for k, unit in enumerate(order, start=1):
        left = len(order) - k  # units still to run backward after this one
        if freed_between_uses:  # this unit plus up to `prefetch` gathered ahead
            during = root_full + min(1 + s.prefetch, left + 1) * biggest
            after = root_full + min(s.prefetch, left) * biggest
        else:  # everything not yet through backward stays gathered
            after = root_full + sum(full[id(u)] for u in order[k:]) * m.param_bytes
            during = after + full[id(unit)] * m.param_bytes
        # While the unit's backward computes: the gradient shards of the units whose
        # reduce-scatter finished, the packed buffers still in flight, its activations.
        shards_done = order[:max(0, k - 1 - pending)]
        grads = grads_all if not m.grads_set_to_none else sum(
            local[id(u)] for u in shards_done) * m.state_bytes
        in_flight = min(k - 1, pending) * full[id(unit)] * m.reduce_bytes
        own_grads = full[id(unit)] * m.param_bytes  # autograd holds them until post-backward
        phases[f"backward of {unit.name}"] = (
            static + grads + remaining + during + in_flight + own_grads)
        remaining -= unit.activation_bytes
        # Its post-backward: the unit is freed first, then its gradients (as autograd made them)
        # are packed and one more reduce-scatter finishes, creating that unit's gradient shard.
        shards_done = order[:max(0, k - pending)]
        grads = grads_all if not m.grads_set_to_none else sum(
            local[id(u)] for u in shards_done) * m.state_bytes
        packed = min(k, pending + 1) * full[id(unit)] * m.reduce_bytes
        phases[f"post-backward of {unit.name}"] = (
            static + grads + remaining + after + full[id(unit)] * m.param_bytes + packed)
    phases["optimizer step"] = static + grads_all
    peak_phase = max(phases, key=phases.get)
    return dict(params=params, grads=grads_all, optimizer=optimizer, activations=activations,
                gathered=gathered, peak=phases[peak_phase], peak_phase=peak_phase)


def estimate_time(m: PlanInputs, s: Setting) -> dict:
    shards = m.shards(s.strategy)
    blocks = [u for u in m.units if not u.is_root]
    total = max(1, sum(u.numel for u in m.units))
    comm_per_unit, first_ag, last_reduce, quant = [], 0.0, 0.0, 0.0
    wire_param = m.wire_param_bytes or m.param_bytes
    wire_reduce = m.wire_reduce_bytes or m.reduce_bytes
    for i, u in enumerate(m.units):
        full = padded_numel(u, shards)
        ag = all_gather_s(full * wire_param, shards, m.link) if s.strategy != "NO_SHARD" else 0.0
        regather = s.strategy in ("FULL_SHARD", "HYBRID_SHARD") and not u.is_root and bool(
            blocks) and u is not blocks[-1]
        # gloo reduces by an in-place all-reduce, except a quantized reduction (an all-to-all)
        reduce_fn = (all_reduce_s if m.reduce_is_all_reduce and not m.wire_reduce_bytes
                     else reduce_scatter_s)
        red = reduce_fn(full * wire_reduce, shards, m.link) if shards > 1 else 0.0
        if m.quant_s_per_byte and s.strategy != "NO_SHARD":
            # per gather: quantize the shard, dequantize every slot; per reduction: quantize
            # the packed gradients, dequantize and sum what arrives (bytes read + written)
            if m.wire_param_bytes:
                quant += (2 if regather else 1) * (
                    (m.state_bytes + 1) * full // shards + (1 + m.param_bytes) * full)
            if m.wire_reduce_bytes:
                quant += (m.reduce_bytes + 1) * full + full + m.reduce_bytes * full // shards
        if m.world_size > shards:  # replicas all-reduce the (shard of the) gradient
            across = m.cross_link if (m.cross_link and s.strategy == "HYBRID_SHARD") else m.link
            red += all_reduce_s(full // shards * m.reduce_bytes, m.world_size // shards, across)
        comm = ag * (2 if regather else 1) + red
        comm_per_unit.append((u, comm))
        if i == 0 or u is (blocks[0] if blocks else None):
            first_ag += ag
        last_reduce = red
    comm = sum(c for _, c in comm_per_unit)
    if s.prefetch == 0:
        exposed = comm
    elif not m.comm_hides:  # issued early, it still competes for the cores the compute uses
        exposed = first_ag + last_reduce + m.contention * max(0.0, comm - first_ag - last_reduce)
    else:
        exposed = first_ag + last_reduce + sum(
            max(0.0, c - m.compute_s * u.numel / total) for u, c in comm_per_unit)
        exposed = min(exposed, comm)
    optimizer = m.adamw_s_per_element * total / shards
    copies = _copy_seconds(m, s, shards, blocks)
    quantize = quant * m.quant_s_per_byte  # counted as not overlapped (a bound)
    return dict(compute=m.compute_s, optimizer=optimizer, comm=comm, exposed_comm=exposed,
                copies=copies, quantize=quantize,
                step=m.compute_s + optimizer + exposed + copies + quantize)


def _copy_seconds(m: PlanInputs, s: Setting, shards: int, blocks: list[UnitSpec]) -> float:
    """Bytes the runtime reads and writes around its collectives, at the measured copy rate (CPU
    only; on GPUs these kernels are short and overlap on their streams): per gather the shard
    into its slot (the CPU all-gather then broadcasts in place), per reduction the pack and the
    epilogue."""
    if not m.copy_bytes_per_s:
        return 0.0
    moved = 0
    for u in m.units:
        full = padded_numel(u, shards)
        gathers = 2 if (s.strategy in ("FULL_SHARD", "HYBRID_SHARD") and not u.is_root
                        and blocks and u is not blocks[-1]) else 1
        if s.strategy != "NO_SHARD":
            moved += gathers * 2 * (full // shards) * m.param_bytes
        moved += 2 * full * m.reduce_bytes + 3 * full // shards * m.reduce_bytes
    return moved / m.copy_bytes_per_s


@dataclass
class Plan:
    model: PlanInputs
    estimates: list[Estimate]
    memory_budget: float | None
    notes: list[str]

    def estimate(self, strategy: str = "FULL_SHARD", prefetch: int = 1) -> Estimate:
        return next(e for e in self.estimates if e.setting == Setting(strategy, prefetch))

    def best(self) -> Estimate | None:
        fitting = [e for e in self.estimates if e.fits is not False]
        return min(fitting, key=lambda e: e.time["step"], default=None)

    def table(self) -> str:
        best = self.best()
        rows = ["| strategy | prefetch | peak memory/rank (MiB) | at | step (s) | comm (s) | "
                "exposed comm (s) | fits |", "|---|---|---|---|---|---|---|---|"]
        for e in self.estimates:
            mark = " (best)" if e is best else ""
            fits = "-" if e.fits is None else ("yes" if e.fits else "no")
            rows.append(f"| {e.setting.strategy}{mark} | {e.setting.prefetch} | "
                        f"{e.memory['peak'] / 2**20:.0f} | {e.memory['peak_phase']} | "
                        f"{e.time['step']:.3f} | {e.time['comm']:.3f} | "
                        f"{e.time['exposed_comm']:.3f} | {fits} |")
        return "\n".join(rows)

    def __str__(self) -> str:
        m = self.model
        head = (f"fsdp_ext plan: {len(m.units)} units, {sum(u.numel for u in m.units) / 1e6:.1f}M "
                f"parameters, world size {m.world_size}, link {m.link.name} (alpha "
                f"{m.link.alpha_s * 1e6:.0f} us, {m.link.bandwidth / 1e9:.2f} GB/s), compute "
                f"{m.compute_s:.3f} s/step")
        budget = (f"memory budget {self.memory_budget / 2**20:.0f} MiB/rank"
                  if self.memory_budget else "no memory budget given")
        return "\n".join([head, budget, *self.notes, "", self.table()])


def build_plan(m: PlanInputs, memory_budget: float | None = None, prefetch=(0, 1, 2),
               strategies=STRATEGIES, notes: list[str] | None = None) -> Plan:
    estimates = []
    for strategy in strategies:
        if strategy == "HYBRID_SHARD" and not (m.per_node and m.world_size > m.per_node):
            continue  # one node: the same as FULL_SHARD
        for depth in prefetch:
            s = Setting(strategy, depth)
            e = Estimate(s, estimate_memory(m, s), estimate_time(m, s))
            if memory_budget is not None:
                e.fits = e.memory["peak"] <= memory_budget
            estimates.append(e)
    return Plan(m, estimates, memory_budget, list(notes or []))


def cpu_saturated(world_size: int, threads: int, ranks_per_node: int | None = None) -> bool:
    """True when this node's ranks' compute threads occupy every core (gloo then competes)."""
    ranks = ranks_per_node or world_size
    return ranks * threads >= (os.cpu_count() or 1)
