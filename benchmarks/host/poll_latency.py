"""How long after the device finished the host's bounded wait notices: the end-of-backward flag
read (runtime/core/host_reads.py: wait_bounded), against the fixed 100 us sleep between queries it
replaced.

An event completes at a random moment (0.05 to 5 ms after the wait starts: a step's last
reduce-scatter and the flags' copy), reported by a stand-in event whose `query()` compares the
clock; each wait's latency is the time from completion to the wait's return. On a GPU that
latency is device idle time (nothing is queued behind the wait).

    python -m benchmarks.host.poll_latency
    python -m benchmarks.host.poll_latency --waits 2000
"""
from __future__ import annotations

import argparse
import datetime
import random
import statistics
import time

from fsdp_ext.runtime.core import host_reads, streams


class _ClockEvent:
    """Completes at `done` (time.monotonic()); synchronize() returns once it has."""

    def __init__(self, done: float):
        self.done = done

    def query(self) -> bool:
        return time.monotonic() >= self.done

    def synchronize(self) -> None:
        while not self.query():
            pass


def _fixed_sleep(event, timeout: datetime.timedelta) -> None:
    """The previous loop: query, else sleep 100 us."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not streams.query(event):
        if time.monotonic() >= deadline:
            raise TimeoutError
        time.sleep(1e-4)
    streams.synchronize(event)


def _latencies(wait, delays: list[float]) -> list[float]:
    timeout = datetime.timedelta(seconds=10)
    out = []
    for delay in delays:
        event = _ClockEvent(time.monotonic() + delay)
        wait(event, timeout)
        out.append(time.monotonic() - event.done)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waits", type=int, default=1000, help="waits per variant (default 1000)")
    args = parser.parse_args()
    rng = random.Random(0)
    delays = [rng.uniform(5e-5, 5e-3) for _ in range(args.waits)]
    print(f"{args.waits} waits, completion 0.05-5 ms after the wait starts; latency from "
          "completion to return, microseconds")
    print("| wait | median | p90 | p99 | max |")
    print("|---|---|---|---|---|")
    for name, wait in (("fixed 100 us sleep (before)", _fixed_sleep),
                       ("queries yielding between them (now)", host_reads.wait_bounded)):
        lat = sorted(_latencies(wait, delays))
        q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1e6  # noqa: E731
        print(f"| {name} | {statistics.median(lat) * 1e6:.1f} | {q(0.9):.1f} | {q(0.99):.1f} | "
              f"{lat[-1] * 1e6:.1f} |")


if __name__ == "__main__":
    main()
