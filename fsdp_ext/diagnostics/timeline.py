"""The FSDP timeline of a step, as data and as a picture.

From the events the runtime records (`fsdp_ext.trace.recording()`) or from a `torch.profiler`
Chrome trace, per rank:

    compute         FWD0 FWD1 FWD2 ...          BWD2 BWD1 BWD0      (red: waiting, grey: launching)
    all-gather      AG0  AG1  AG2 ...   AG1 AG0                     (issue -> end of its wait)
    reduce-scatter                           RS2  RS1  RS0

Unit numbers follow the forward order (0 is the root). A collective's bar runs from the moment it is
issued to the end of the wait for it. Two parts of it are *exposed*, time in which the compute lane
ran no model code for it: the launch (copy-in or gradient pack, then queueing the collective) and
the wait. The rest is *hidden* behind compute; that figure is an upper bound, as the collective may
have finished before anyone waited for it.

    python -m fsdp_ext.diagnostics.timeline trace_rank0.json [trace_rank1.json ...] -o timeline.png
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass

import torch.distributed as dist

from ..runtime.core.trace import Event

_COMM = {"all_gather": "AG", "reduce_scatter": "RS"}


@dataclass
class Span:
    lane: str       # "compute" | "all_gather" | "reduce_scatter"
    label: str      # "FWD1", "BWD0", "AG2", "RS1"; exposed parts: "wait AG2", "launch RS1"
    start: float    # seconds since the rank's first event
    end: float
    exposed: bool = False  # launching or waiting for a collective instead of computing


def unit_numbers(events: list[Event]) -> dict[str, int]:
    """Unit name -> its position in the forward order (the root, "", runs first)."""
    numbers: dict[str, int] = {}
    for e in events:
        if e.kind == "forward.begin" and e.unit not in numbers:
            numbers[e.unit] = len(numbers)
    for e in events:  # units seen only in backward or communication still get a number
        numbers.setdefault(e.unit, len(numbers))
    return numbers


def spans(events: list[Event]) -> list[Span]:
    """Compute-lane segments (innermost running unit) and communication bars of one rank."""
    if not events:
        return []
    events = sorted(events, key=lambda e: e.t)
    t0, num = events[0].t, unit_numbers(events)
    out: list[Span] = []
    stack: list[str] = []          # "FWD1", "BWD0", ...: units whose compute is open, innermost last
    blocked: str | None = None     # "wait AG2" / "launch RS1" while busy with a collective
    seg_start = t0
    issued: dict[tuple[str, str], list[float]] = {}
    launch_begin: dict[tuple[str, str], float] = {}
    wait_begin: dict[tuple[str, str], float] = {}

    for e in events:
        before = blocked or (stack[-1] if stack else None)
        phase, _, edge = e.kind.rpartition(".")
        name = f"{num[e.unit]}"
        if e.kind in ("forward.begin", "backward.begin"):
            stack.append(("FWD" if phase == "forward" else "BWD") + name)
        elif e.kind in ("forward.end", "backward.end"):
            tag = ("FWD" if phase == "forward" else "BWD") + name
            if tag in stack:  # a unit used twice ends its backward twice; only one is open
                del stack[len(stack) - 1 - stack[::-1].index(tag)]
        elif edge == "issue" and phase in _COMM:
            issued.setdefault((phase, e.unit), []).append(e.t)
            blocked, launch_begin[(phase, e.unit)] = f"launch {_COMM[phase]}{name}", e.t
        elif edge == "issued" and phase in _COMM:
            blocked, begin = None, launch_begin.pop((phase, e.unit), e.t)
            out.append(Span(phase, f"launch {_COMM[phase]}{name}", begin - t0, e.t - t0, True))
        elif phase.endswith(".wait") and phase[:-5] in _COMM:
            comm, key = phase[:-5], (phase[:-5], e.unit)
            if edge == "begin":
                blocked, wait_begin[key] = f"wait {_COMM[comm]}{name}", e.t
            else:
                blocked = None
                begin = wait_begin.pop(key, e.t)
                start = issued[key].pop(0) if issued.get(key) else begin
                out.append(Span(comm, _COMM[comm] + name, start - t0, e.t - t0))
                out.append(Span(comm, f"wait {_COMM[comm]}{name}", begin - t0, e.t - t0, True))
        after = blocked or (stack[-1] if stack else None)
        if after != before:
            if before is not None and e.t > seg_start:
                out.append(Span("compute", before, seg_start - t0, e.t - t0,
                                exposed=" " in before))
            seg_start = e.t
    end = events[-1].t - t0
    for (comm, unit), starts in issued.items():  # issued but not yet waited for when recording ended
        out.extend(Span(comm, _COMM[comm] + str(num[unit]), s - t0, end) for s in starts)
    return out


def comm_stats(events: list[Event]) -> dict[str, dict[str, float]]:
    """Seconds each kind of collective spent in flight, exposed (launch + wait) and hidden."""
    stats = {c: dict(count=0, in_flight=0.0, exposed=0.0) for c in _COMM}
    for s in spans(events):
        if s.lane in stats:
            if s.exposed:
                stats[s.lane]["exposed"] += s.end - s.start
            else:
                stats[s.lane]["in_flight"] += s.end - s.start
                stats[s.lane]["count"] += 1
    for v in stats.values():
        v["hidden"] = max(v["in_flight"] - v["exposed"], 0.0)
    return stats


def last_step(events: list[Event]) -> list[Event]:
    """The events from the root's last forward onwards (the root's name is "")."""
    starts = [i for i, e in enumerate(events) if e.kind == "forward.begin" and e.unit == ""]
    if not starts:
        return list(events)
    i = starts[-1]
    # A profiler trace opens the root's forward after its all-gather and the first prefetch:
    # those belong to the step.
    while i > 0 and events[i - 1].kind.startswith("all_gather"):
        i -= 1
    return events[i:]


def gather_to_rank0(events: list[Event]) -> list[list[Event]] | None:
    """Every rank's events on rank 0 (a list per rank); None on the other ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return [list(events)]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(list(events), out, dst=0)
    return out


# Other fsdp_ext ranges (copy_in, pack_grads, ...) nest inside these and are not lanes of their own.
_LABEL = re.compile(r"^fsdp_ext::(forward|backward|(?:all_gather|reduce_scatter)(?:\.wait)?)"
                    r"\[(.*)\]$")


def events_from_chrome_trace(path: str) -> list[Event]:
    """Recorder-style events from the `fsdp_ext::...` ranges of a profiler Chrome trace."""
    with open(path) as f:
        trace = json.load(f)
    events = []
    for ev in trace.get("traceEvents", []):
        m = _LABEL.match(str(ev.get("name", "")))
        if not m or ev.get("ph") != "X":
            continue
        what, unit = m.group(1), "" if m.group(2) == "root" else m.group(2)
        start, end = ev["ts"] * 1e-6, (ev["ts"] + ev.get("dur", 0)) * 1e-6
        if what in _COMM:  # the range is the launch: issue .. issued
            events += [Event(what + ".issue", unit, start), Event(what + ".issued", unit, end)]
        else:  # forward, backward, all_gather.wait, reduce_scatter.wait
            events += [Event(what + ".begin", unit, start), Event(what + ".end", unit, end)]
    return sorted(events, key=lambda e: e.t)


Label = tuple[str, tuple, float, float]  # (text, (rank, lane, sub-row), left, right) in pixels
DPI = 130  # the PNG's resolution; labels are measured at it


COLORS = {"FWD": "#4C72B0", "BWD": "#55A868", "AG": "#8DA0CB", "RS": "#E5C494",
          "wait": "#D62728", "launch": "#6E6E6E", "OPT": "#8172B2", "sync": "#FF7F0E"}
LANES = ["reduce_scatter", "all_gather", "compute"]  # bottom to top within a rank
LEGEND = [("FWD", "forward compute"), ("BWD", "backward compute"), ("AG", "all-gather in flight"),
          ("RS", "reduce-scatter in flight"), ("launch", "exposed: launching a collective"),
          ("wait", "exposed: waiting for a collective")]


def draw(per_rank: list[list[Event]], path: str, title: str = "") -> list[Label]:
    """One PNG: for each rank a compute lane, an all-gather lane and a reduce-scatter lane, and
    under the title each rank's communication totals over the events drawn (one step, as
    `last_step` cuts them), said to be that, not an average over a run.
    Returns the labels written on bars: (label, (rank, lane, sub-row), left, right), in pixels."""
    notes = []
    for rank, events in enumerate(per_rank):
        stats = comm_stats(events)
        notes.append(f"rank {rank}, this step: " + ", ".join(
            f"{_COMM[c]} {v['in_flight'] * 1e3:.1f} ms in flight / {v['exposed'] * 1e3:.1f} ms exposed"
            for c, v in stats.items()))
    numbers = unit_numbers(per_rank[0]) if per_rank else {}
    return draw_spans([spans(events) for events in per_rank], path, title, notes,
                      "units: " + ", ".join(f"{i} = {u or 'root'}" for u, i in numbers.items()))


def draw_spans(groups: list[list[Span]], path: str, title: str = "", notes: list[str] = (),
               footer: str = "", group_names: list[str] | None = None, lanes: list[str] = LANES,
               legend: list[tuple[str, str]] = LEGEND,
               xlabel: str = "ms since the step's first event (per rank)") -> list[Label]:
    """Draw groups of lanes (a rank's, or a modelled step's) from their spans, as `draw` does.

    Bars on the compute lane and any lane whose spans are not `exposed` are drawn solid; an
    exposed span on another lane marks the bottom edge of the bar with the same label that it
    starts in. `legend`: (colour key, text) pairs; a span's colour key is its label's first word
    when exposed, else its label without the trailing unit number (COLORS)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = COLORS
    n = len(groups)
    names = group_names or [f"rank {i}" for i in range(n)]
    fig, ax = plt.subplots(figsize=(16, 1.2 + 1.5 * n * len(lanes) / 3))
    span_ms = max((s.end for group in groups for s in group), default=1.0) * 1e3
    yticks, ylabels = [], []
    candidates = []  # (label, bar left, bar width, y, fontsize, sub-row): placed after the layout
    for rank, rank_spans in enumerate(groups):
        base = (n - 1 - rank) * (len(lanes) + 0.6)
        for li, lane in enumerate(lanes):
            y = base + li
            yticks.append(y + 0.4)
            ylabels.append(f"{names[rank]} {lane.replace('_', '-')}")
            bars = [s for s in rank_spans if s.lane == lane and not (lane != "compute" and s.exposed)]
            rows = _stack_rows(bars)
            depth = max(rows.values(), default=0) + 1
            height = 0.8 / depth
            for s in bars:
                x, w = s.start * 1e3, (s.end - s.start) * 1e3
                yb = y + rows[id(s)] * height
                ax.broken_barh([(x, w)], (yb, height * 0.95), facecolors=colors[_kind(s)],
                               edgecolor="white", linewidth=0.3)
                candidates.append((s.label.split(" ")[-1], x, w, yb + height * 0.47,
                                   6 if depth > 1 else 7, (rank, lane, rows[id(s)])))
                # The exposed parts of a collective's bar, marked along its bottom edge.
                for part in [p for p in rank_spans if lane != "compute" and p.lane == lane
                             and p.exposed and p.label.split(" ")[-1] == s.label
                             and s.start <= p.start <= s.end]:
                    ax.broken_barh([(part.start * 1e3, (part.end - part.start) * 1e3)],
                                   (yb, height * 0.25), facecolors=colors[_kind(part)])
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, span_ms * 1.01)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title((title + "\n" if title else "") + "; ".join(notes), fontsize=9)
    handles = [Patch(color=colors[key], label=text) for key, text in legend]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles), framealpha=0.9,
              bbox_to_anchor=(1.0, -0.12 - 0.1 / max(n, 1)))
    fig.text(0.01, 0.005, footer, fontsize=7)
    fig.tight_layout()
    placed = _place_labels(fig, ax, candidates)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return placed


def _place_labels(fig, ax, candidates) -> list[Label]:
    """Write each bar's label where it fits inside its bar and clears the previous label of its
    sub-row, measured with the renderer once the layout is final (narrow neighbours such as the
    root's FWD0 and BWD0 segments would otherwise print over each other); drop the others."""
    fig.set_dpi(DPI)
    renderer = fig.canvas.get_renderer()
    placed, right_edge = [], {}
    for label, x, w, y, size, row in sorted(candidates, key=lambda c: (c[5], c[1])):
        left, right = (ax.transData.transform([(x, y), (x + w, y)])[:, 0])
        text = ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=size,
                       color="white")
        box = text.get_window_extent(renderer)
        if box.x0 < left or box.x1 > right or box.x0 < right_edge.get(row, float("-inf")):
            text.remove()
            continue
        right_edge[row] = box.x1
        placed.append((label, row, box.x0, box.x1))
    return placed


def _kind(s: Span) -> str:
    """Colour key: "FWD", "BWD", "AG", "RS", or the exposed part's "wait" / "launch"."""
    return s.label.split(" ")[0] if s.exposed else re.sub(r"\d+$", "", s.label)


def _stack_rows(bars: list[Span]) -> dict[int, int]:
    """Overlapping bars of one lane (two all-gathers in flight) go on separate sub-rows."""
    rows: dict[int, int] = {}
    ends: list[float] = []
    for s in sorted(bars, key=lambda s: s.start):
        for i, end in enumerate(ends):
            if s.start >= end:
                ends[i], rows[id(s)] = s.end, i
                break
        else:
            rows[id(s)] = len(ends)
            ends.append(s.end)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="Chrome trace JSON files, one per rank")
    parser.add_argument("-o", "--output", default="timeline.png")
    args = parser.parse_args()
    draw([last_step(events_from_chrome_trace(p)) for p in args.traces], args.output)
    print(args.output)


if __name__ == "__main__":
    main()
