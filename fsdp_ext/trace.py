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


@contextlib.contextmanager
def span(kind: str, unit_name: str):
    """A profiler range plus begin/end events."""
    RECORDER.add(kind + ".begin", unit_name)
    with torch.profiler.record_function(label(unit_name, kind)):
        yield
    RECORDER.add(kind + ".end", unit_name)
