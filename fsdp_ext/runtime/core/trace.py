"""A cheap, opt-in record of the runtime's timeline (collectives issued/waited, unit compute).

Every event is also a `torch.profiler.record_function` range, so a profiler trace shows the same
labels; this in-process list exists so tests and the example trainer can check the *order* of events
without running the profiler.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Event:
    kind: str    # e.g. "all_gather.issue", "forward.begin", "reduce_scatter.wait"
    unit: str    # the unit's fully qualified name ("" for the root)
    t: float     # time.perf_counter() seconds


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.enabled = False

    def add(self, kind: str, unit: str) -> None:
        if self.enabled:
            self.events.append(Event(kind, unit, time.perf_counter()))

    def clear(self) -> None:
        self.events.clear()

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled

    def drop_from(self, index: int) -> None:
        """Forget the events from `index` on (a borrower's own, once it is done)."""
        del self.events[index:]


RECORDER = Recorder()


@contextlib.contextmanager
def recording():
    """Collect events inside the block: `with recording() as events: ...`."""
    RECORDER.clear()
    RECORDER.enabled = True
    try:
        yield RECORDER.events
    finally:
        RECORDER.enabled = False


def label(unit_name: str, what: str) -> str:
    return f"fsdp_ext::{what}[{unit_name or 'root'}]"


def _profiling() -> bool:
    """Whether a profiler collects: a range costs tens of microseconds of Python even when nobody
    records it, several per unit, so ranges are opened only then (always, if torch cannot say)."""
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True)


def profiler_range(what: str, unit_name: str):
    """The profiler range `fsdp_ext::{what}[unit]` while a profiler collects, else nothing."""
    if _profiling():
        return torch.profiler.record_function(label(unit_name, what))
    return contextlib.nullcontext()


@contextlib.contextmanager
def span(kind: str, unit_name: str):
    """A profiler range plus begin/end events."""
    RECORDER.add(kind + ".begin", unit_name)
    with profiler_range(kind, unit_name):
        yield
    RECORDER.add(kind + ".end", unit_name)


# Profiler ranges that open in one hook and close in another: a unit's forward compute runs between
# its forward pre-hook and post-hook, its backward compute between its pre-backward hook and its
# post-backward. Keyed by (kind, unit object id); a second begin while one is open is a no-op (a unit
# whose outputs each fire the pre-backward hook).
_OPEN_RANGES: dict[tuple[str, int], torch.profiler.record_function] = {}


def begin_range(kind: str, unit) -> None:
    """Open the profiler range `fsdp_ext::{kind}[unit]` (closed by `end_range`)."""
    key = (kind, id(unit))
    if key not in _OPEN_RANGES and _profiling():
        rf = torch.profiler.record_function(label(unit.name, kind))
        rf.__enter__()
        _OPEN_RANGES[key] = rf


def end_range(kind: str, unit) -> None:
    rf = _OPEN_RANGES.pop((kind, id(unit)), None)
    if rf is not None:
        rf.__exit__(None, None, None)
