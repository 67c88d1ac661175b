"""CPU offload with side streams: the host shards that a side stream reads while the host may
write them next, and the host code that reads what a side stream copied to the host.

The all-gather stream copies host shards to the device without blocking the host; the
reduce-scatter stream copies reduced gradients to the host. The optimizer step (and a state-dict
load, a user edit) writes the shards; the offloaded gradient epilogues read the copies. Both wait
for one host sync per step (`sync`), merged with the collective tags' flag read where there is
one (schedule.py: _end_of_step_sync). `wait_bounded` is the host's bounded wait for an event,
the one the tags' flag read makes (collective_tags.py: read_flags).
"""
from __future__ import annotations

import datetime
import time

import torch

from . import streams


class HostReads:
    def __init__(self, device: torch.device):
        self.device = device
        self.event = None     # the latest side-stream read of the host shards, not yet waited
        self.work: list = []  # host code to run after the next host sync
        self._ordered = False  # the compute stream waited for the reads; the host not yet

    def note_read(self, event) -> None:
        """An all-gather stream's copy of host shards, recorded by `event`; `sync` waits for the
        latest before the host may write them."""
        self.event = event

    def after_sync(self, work) -> None:
        """Run `work()` (host code reading what the device copied to the host) after the host's
        next wait for the device: CPU offload's gradient epilogues, at the end of backward."""
        self.work.append(work)

    def order(self) -> None:
        """The compute stream waits for the latest read of the host shards (no host sync)."""
        if self.event is not None:
            streams.wait_event(streams.current_stream(self.device), self.event)
            self.event = None
            self._ordered = True

    def sync(self, already_synced: bool = False) -> None:
        """Once per step: block the host until the all-gather stream has read every host shard it
        was asked to (the optimizer step writes them next) and the reduce-scatter stream has
        copied every gradient to the host, then run the host work that reads those copies. One
        wait for both: the compute stream waited for every reduce-scatter it finished, and waits
        here for the host shards' reads. Nothing to do otherwise."""
        if self.event is None and not self.work and not self._ordered:
            return
        self.order()
        if not already_synced:
            current = streams.current_stream(self.device)
            streams.synchronize(streams.record_event(current))
        self._ordered = False
        work, self.work = self.work, []
        for run in work:
            run()


def wait_bounded(event, timeout: datetime.timedelta | None) -> None:
    """Block the host until `event` completed; TimeoutError after `timeout` (None: unbounded).

    Polls without sleeping, yielding the interpreter between queries (`sleep(0)`: the heartbeat
    thread still runs), as CUDA's own event wait spins by default: this is the end of backward,
    nothing else is queued, and every microsecond between the event and the host noticing it is
    device idle time. A fixed 100 us sleep between queries (about 160 us on Linux with timer
    slack) added that much on average (benchmarks/host/poll_latency.py measures both)."""
    if timeout is not None:
        deadline = time.monotonic() + timeout.total_seconds()
        while not streams.query(event):
            if time.monotonic() >= deadline:
                raise TimeoutError("timed out waiting for the step's collectives")
            time.sleep(0)
    streams.synchronize(event)
