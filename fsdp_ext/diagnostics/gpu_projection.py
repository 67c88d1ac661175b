"""PROJECTION, not a measurement: a recorded training step (launch_trace.py) replayed on a
modelled GPU, to see on a CPU-only machine where the host would hold the GPU back.

    costs = CostModel(H100, RING_FORMULAS)         # both from planner/comm_model.py
    projection = replay(trace, costs)              # trace: LaunchTrace of one step
    summary = summarize(projection)                # step time, compute idle, exposed comm, ...
    draw([projection, ...], ["before", ...], "step.png", "what was recorded")

Why: a host sync inside a step (an event synchronize, `.item()`, a blocking copy) drains the
GPU's queue, so the next kernels start only when the host has launched them again: gaps on the
compute stream that no CPU measurement shows. The trace holds the order and the size of every
piece of work; this module gives each a GPU duration and a host launch cost and replays them.

Cost model (CostModel; built on planner/comm_model.py: its H100 figures, stated there, not
measured, and its ring formulas, both handed in, as diagnostics may not import the planner):
  * a matmul-like op: FLOPs / (peak_flops * mfu), at TF32 (half the bf16 peak) for fp32 inputs;
  * any other kernel: bytes read + written / memory_bandwidth;
  * every kernel: at least `kernel_floor_s`;
  * a collective: the ring alpha-beta formulas (all_gather_s, reduce_scatter_s, all_reduce_s) on
    its full bytes at `world_size` ranks over the link a ring of that size uses (NVLink inside a
    node of 8), whatever world the recording ran at; sizes of shard-sized work (`per_shard`) are
    scaled by recorded world / world_size;
  * the host: `host_launch_s` per op that launches a kernel (collectives included) and
    `host_other_s` per op that launches none (views, allocations, ops on host memory) and per
    stream or event call. An assumption (eager PyTorch's dispatch and launch cost); the Python of
    the model and of the runtime between ops is not counted, so the host is, if anything, faster
    here than in reality.

Replay rules (one host thread, streams that run their work in order):
  * the host issues the records in order, paying its cost for each;
  * an op on stream S starts at max(its issue time, the end of S's previous op, every event and
    stream S waited on) and runs for its cost;
  * record_event marks S's position (the end of everything queued on S so far);
  * a host sync moves the host clock to the end of the work it waits for (an event, a stream's
    queued work, or, for `.item()` and blocking copies, the op itself);
  * the step starts with an idle GPU and ends when the host and every stream are done.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .launch_trace import (HOST, EventRecord, EventWait, HostSync, Launch, LaunchTrace, Mark,
                           StreamWait)

EPS = 1e-12  # seconds: below this a gap is float noise
_SHORT = {"all_gather": "AG", "reduce_scatter": "RS"}


@dataclass(frozen=True)
class CostModel:
    """Stated assumptions, not measurements (see the module docstring).

    cluster: the accelerator's rates and links (planner.comm_model.Cluster, e.g. H100).
    collective_s: kind -> seconds(full_bytes, world_size, link) (planner.comm_model.RING_FORMULAS);
        other kinds are costed as all-gathers.
    """

    cluster: Any
    collective_s: Mapping[str, Callable[[float, int, Any], float]]
    world_size: int = 8             # ranks of every collective (one node of 8: NVLink)
    kernel_floor_s: float = 3e-6    # the shortest kernel, launch latency on the device included
    host_launch_s: float = 6e-6     # host time to dispatch and launch one kernel
    host_other_s: float = 2e-6      # host time of an op without a kernel, or an event/stream call
    fp32_matmul_fraction: float = 0.5  # TF32 tensor cores: half the bf16 peak

    def gpu_seconds(self, launch: Launch, recorded_world: int) -> float:
        """How long `launch` runs on its stream."""
        if launch.collective:
            formula = self.collective_s.get(launch.collective, self.collective_s["all_gather"])
            return formula(launch.bytes, self.world_size, self.cluster.link_for(self.world_size))
        if launch.flops:
            fraction = self.fp32_matmul_fraction if launch.dtype == "float32" else 1.0
            seconds = launch.flops / (self.cluster.peak_flops * self.cluster.mfu * fraction)
        else:
            scale = recorded_world / self.world_size if launch.per_shard else 1.0
            seconds = launch.bytes * scale / self.cluster.memory_bandwidth
        return max(seconds, self.kernel_floor_s)

    def host_seconds(self, record) -> float:
        if isinstance(record, Mark):
            return 0.0
        if isinstance(record, Launch) and record.kernel and record.stream != HOST:
            return self.host_launch_s
        return self.host_other_s

    def describe(self) -> str:
        c = self.cluster
        link = c.link_for(self.world_size)
        return (f"{self.world_size} x {c.name.split(',')[0]}: {c.peak_flops / 1e12:.0f} TFLOP/s "
                f"bf16 (TF32: x{self.fp32_matmul_fraction:g}) at {100 * c.mfu:.0f}% MFU, "
                f"{c.memory_bandwidth / 1e12:.2f} TB/s memory, ring collectives over {link.name} "
                f"(alpha {link.alpha_s * 1e6:g} us per step, {link.bandwidth / 1e9:.0f} GB/s), "
                f"kernels >= {self.kernel_floor_s * 1e6:g} us; host {self.host_launch_s * 1e6:g} "
                f"us per kernel launch, {self.host_other_s * 1e6:g} us per other op or "
                "stream/event call (assumed)")


@dataclass
class Placed:
    """One kernel on the modelled GPU."""

    record: Launch
    issue: float                # when the host had launched it
    start: float
    end: float
    cause: str                  # what its start waited for: "stream" (its stream was busy),
    #                             "host" (not launched yet), or the stream whose event it waited on
    cause_of: tuple = (None, "")  # that stream's last work then: (unit, role)


@dataclass
class Projection:
    trace: LaunchTrace
    costs: CostModel
    placed: list[Placed]
    host_busy: list[tuple[float, float, Launch | None]]   # host launching (the last op launched)
    host_waits: list[tuple[float, float, object]]          # host blocked in a sync (the record)
    step_s: float
    syncs: int                  # host-sync records and syncing ops in the trace


def replay(trace: LaunchTrace, costs: CostModel) -> Projection:
    """Place every kernel of `trace` on the modelled GPU (the module docstring's rules)."""
    host = 0.0
    end: dict[str, float] = {}                    # stream -> end of its queued work
    floor: dict[str, tuple[float, str, tuple]] = {}  # stream -> earliest start from its waits
    events: dict[int, tuple[float, str, tuple]] = {}  # event -> (time, stream, its last work)
    last: dict[str, tuple] = {}                   # stream -> (unit, role) of its latest op
    placed, busy, waits, syncs = [], [], [], 0
    latest: Launch | None = None

    def queued(stream: str) -> float:  # when everything queued on `stream` so far has run
        return max(end.get(stream, 0.0), floor.get(stream, (0.0,))[0])

    def block_host(until: float, record) -> None:
        nonlocal host
        if until > host + EPS:
            waits.append((host, until, record))
            host = until

    for record in trace.records:
        if isinstance(record, Mark):
            continue
        if isinstance(record, Launch):
            latest = record
        cost = costs.host_seconds(record)
        busy.append((host, host + cost, latest))
        host += cost
        if isinstance(record, Launch):
            syncs += bool(record.sync)
            if record.stream == HOST or not record.kernel:
                continue
            s = record.stream
            prev = end.get(s, 0.0)
            wait_t, wait_stream, wait_of = floor.get(s, (0.0, "", (None, "")))
            start = max(host, prev, wait_t)
            if prev >= host and prev >= wait_t:
                cause, of = "stream", last.get(s, (None, ""))
            elif wait_t >= host:
                cause, of = wait_stream, wait_of
            else:
                cause, of = "host", (None, "")
            finish = start + costs.gpu_seconds(record, trace.recorded_world)
            placed.append(Placed(record, host, start, finish, cause, of))
            end[s], last[s] = finish, (record.unit, record.role)
            if record.sync:  # the host waits for this op itself
                block_host(finish, record)
        elif isinstance(record, EventRecord):
            events[record.event] = (queued(record.stream), record.stream,
                                    last.get(record.stream, (None, "")))
        elif isinstance(record, EventWait):
            t, stream, of = events.get(record.event, (0.0, "", (None, "")))
            if t > floor.get(record.stream, (0.0,))[0]:
                floor[record.stream] = (t, stream, of)
        elif isinstance(record, StreamWait):
            t = queued(record.other)
            if t > floor.get(record.stream, (0.0,))[0]:
                floor[record.stream] = (t, record.other, last.get(record.other, (None, "")))
        elif isinstance(record, HostSync):
            syncs += 1
            if record.event is not None:
                until = events.get(record.event, (0.0,))[0]
            elif record.stream is None:
                until = max((queued(s) for s in set(end) | set(floor)), default=0.0)
            else:
                until = queued(record.stream)
            block_host(until, record)
    step = max([host, *end.values()])
    return Projection(trace, costs, placed, busy, waits, step, syncs)


# ---- what the replay says ----------------------------------------------------------------------
def _is_compute(stream: str) -> bool:
    return stream.startswith("compute")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1] + EPS:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(a: float, b: float, intervals: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in intervals)


def _minus(a: float, b: float, intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of [a, b] outside the (sorted, disjoint) intervals."""
    out, t = [], a
    for x, y in intervals:
        if y <= t or x >= b:
            continue
        if x > t + EPS:
            out.append((t, x))
        t = max(t, y)
    if b > t + EPS:
        out.append((t, b))
    return out


@dataclass
class Gap:
    start: float
    end: float
    cause: str          # "comm": waiting for a collective's stream; "sync": nothing launched yet
    #                     because the host was blocked in a sync during the gap; "host": nothing
    #                     launched yet, the host busy launching other work (launch-bound);
    #                     "end": the compute stream's work ended before the step did
    of: tuple = (None, "")  # the work waited for: (unit, role)


def compute_gaps(p: Projection) -> list[Gap]:
    """Idle intervals of the compute stream from the step's start to its end."""
    gaps, t = [], 0.0
    for x in (x for x in p.placed if _is_compute(x.record.stream)):
        if x.start > t + EPS:
            if x.cause not in ("host", "stream") and not _is_compute(x.cause):
                cause = "comm"
            elif any(t - EPS <= b and a <= x.start for a, b, _ in p.host_waits):
                cause = "sync"  # the host was blocked while the stream ran dry
            else:
                cause = "host"
            gaps.append(Gap(t, x.start, cause, x.cause_of))
        t = max(t, x.end)
    if p.step_s > t + EPS:
        gaps.append(Gap(t, p.step_s, "end"))
    return gaps


def exposed_comm(p: Projection) -> dict[tuple, dict[str, float]]:
    """Per (unit, collective): seconds its collectives ran, and how many of them no compute-stream
    work overlapped (exposed)."""
    busy = _union([(x.start, x.end) for x in p.placed if _is_compute(x.record.stream)])
    out: dict[tuple, dict[str, float]] = {}
    for x in p.placed:
        if not x.record.collective:
            continue
        key = (x.record.unit, x.record.role or x.record.collective)
        row = out.setdefault(key, dict(count=0, seconds=0.0, exposed=0.0))
        row["count"] += 1
        row["seconds"] += x.end - x.start
        row["exposed"] += (x.end - x.start) - _overlap(x.start, x.end, busy)
    return out


def summarize(p: Projection) -> dict:
    """The figures of one projected step (seconds)."""
    compute = [x for x in p.placed if _is_compute(x.record.stream)]
    gaps = compute_gaps(p)
    ahead = [x.start - x.issue for x in compute]
    comm = exposed_comm(p)
    by_kind: dict[str, dict[str, float]] = {}
    for (_, kind), row in comm.items():
        total = by_kind.setdefault(kind, dict(count=0, seconds=0.0, exposed=0.0))
        for k in total:
            total[k] += row[k]
    per_unit: dict[str, float] = {}  # compute-stream kernel time of each unit's forward/backward
    for x in compute:
        if x.record.phase != "optimizer" and x.record.unit is not None:
            per_unit[x.record.unit] = per_unit.get(x.record.unit, 0.0) + x.end - x.start
    return dict(
        step_s=p.step_s,
        compute_units=per_unit,
        optimizer_s=sum(x.end - x.start for x in compute if x.record.phase == "optimizer"),
        compute_busy_s=sum(b - a for a, b in _union([(x.start, x.end) for x in compute])),
        compute_kernels=len(compute),
        idle_s=sum(g.end - g.start for g in gaps), gaps=len(gaps),
        largest_gap_s=max((g.end - g.start for g in gaps), default=0.0),
        idle_host_s=sum(g.end - g.start for g in gaps if g.cause == "host"),
        idle_sync_s=sum(g.end - g.start for g in gaps if g.cause == "sync"),
        idle_comm_s=sum(g.end - g.start for g in gaps if g.cause == "comm"),
        run_ahead_min_s=min(ahead, default=0.0),
        run_ahead_median_s=statistics.median(ahead) if ahead else 0.0,
        starved_launches=sum(a <= EPS for a in ahead),
        host_syncs=p.syncs, runtime_host_syncs=sum(
            r.runtime for r in p.trace.records
            if isinstance(r, HostSync) or (isinstance(r, Launch) and r.sync)),
        host_blocked_s=sum(b - a for a, b, _ in p.host_waits),
        host_blocking_syncs=len(p.host_waits),
        comm=by_kind,
        units={f"{unit}|{kind}": row for (unit, kind), row in comm.items()})


# ---- as a picture ------------------------------------------------------------------------------
LANES = ["reduce_scatter", "all_gather", "compute", "host"]  # bottom to top
LEGEND = [("FWD", "forward"), ("BWD", "backward"), ("OPT", "optimizer step"),
          ("AG", "all-gather stream"), ("RS", "reduce-scatter stream"),
          ("wait", "compute idle: waiting for a collective (on comm lanes: exposed)"),
          ("sync", "host blocked in a sync; compute idle after it"),
          ("launch", "compute idle: host still launching (launch-bound)")]


def unit_numbers(trace: LaunchTrace) -> dict[str, int]:
    """Unit name -> position in the forward order (the root first), as timeline.py numbers."""
    from .timeline import unit_numbers as numbers
    return numbers([r for r in trace.records if isinstance(r, Mark)])


def _label(unit, phase: str, role: str, numbers: dict[str, int]) -> str:
    n = "" if unit is None else str(numbers.get(unit, ""))
    if role in _SHORT:
        return _SHORT[role] + n
    if phase == "optimizer":
        return "OPT"
    return ("BWD" if phase == "backward" else "FWD") + n


def _merged(spans: list) -> list:
    """Adjacent spans of one lane with the same label, as one."""
    out = []
    for s in spans:
        if out and out[-1].label == s.label and out[-1].exposed == s.exposed \
                and s.start <= out[-1].end + EPS:
            out[-1].end = max(out[-1].end, s.end)
        else:
            out.append(s)
    return out


def to_spans(p: Projection, numbers: dict[str, int] | None = None) -> list:
    """The projected step as timeline.Span bars: the host lane (launching, labelled by the unit
    it launches for; blocked in syncs), the compute lane with its idle gaps (exposed: waiting for
    a collective, or for the host), and the collective streams with their exposed parts."""
    from .timeline import Span
    numbers = numbers if numbers is not None else unit_numbers(p.trace)
    out = []
    host = [Span("host", _label(r.unit, r.phase, "", numbers) if r else "FWD", a, b)
            for a, b, r in p.host_busy if b > a]
    out += _merged(host) + [Span("host", "sync", a, b) for a, b, _ in p.host_waits]
    compute = [Span("compute", _label(x.record.unit, x.record.phase, "", numbers), x.start,
                    x.end) for x in p.placed if _is_compute(x.record.stream)]
    for g in compute_gaps(p):
        unit, role = g.of
        label = (f"wait {_label(unit, '', role, numbers)}" if g.cause == "comm"
                 and role in _SHORT else "sync" if g.cause == "sync" else "launch host")
        compute.append(Span("compute", label, g.start, g.end, exposed=True))
    out += _merged(sorted(compute, key=lambda s: s.start))
    busy = _union([(x.start, x.end) for x in p.placed if _is_compute(x.record.stream)])
    for lane in ("all_gather", "reduce_scatter"):
        mine = [x for x in p.placed if x.record.stream == lane]
        out += _merged([Span(lane, _label(x.record.unit, x.record.phase, x.record.role or lane,
                                          numbers), x.start, x.end) for x in mine])
        for x in (x for x in mine if x.record.collective):
            label = _label(x.record.unit, x.record.phase, x.record.role or lane, numbers)
            out += [Span(lane, f"wait {label}", a, b, exposed=True)
                    for a, b in _minus(x.start, x.end, busy)]
    return out


def draw(projections: list[Projection], names: list[str], path: str, title: str) -> None:
    """One PNG, one group of lanes per projection (same time axis), in timeline.py's style."""
    from .timeline import draw_spans
    numbers = unit_numbers(projections[0].trace)
    notes = []
    for name, p in zip(names, projections):
        s = summarize(p)
        notes.append(f"{name}: step {s['step_s'] * 1e3:.2f} ms, compute idle "
                     f"{s['idle_s'] * 1e3:.2f} ms in {s['gaps']} gaps")
    draw_spans([to_spans(p, numbers) for p in projections], path, "PROJECTION: " + title, notes,
               "units: " + ", ".join(f"{i} = {u or 'root'}" for u, i in numbers.items()),
               group_names=names, lanes=LANES, legend=LEGEND,
               xlabel="ms since the step's start (PROJECTION: modelled GPU time, not measured)")
