"""Peak bytes of live CPU tensors, from the profiler's allocator events (independent of malloc).

Process RSS (rss.py) also counts what glibc keeps after a free, imported libraries and thread
stacks; on these machines that moves a framework's peak by tens of MB either way. PyTorch's CPU
allocator, while the profiler runs with profile_memory=True, reports every allocation and free
together with the running total of the bytes it allocated since profiling began ("Total
Allocated" of each "[memory]" event). Profiling from before the model exists therefore gives the
exact live tensor bytes at every allocation; the peak inside a marked window is the framework's
tensor peak. Allocations made by threads the profiler does not follow (gloo's workers) are not in
the total, and neither are their frees.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile

import torch

MARK = "bench::window"


class TensorMemory:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.prof = None
        self.cuda_peak = 0

    def __enter__(self) -> "TensorMemory":
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                               profile_memory=True)
            self.prof.__enter__()
        return self

    @contextlib.contextmanager
    def window(self):
        """Mark the part of the run whose peak counts (the training steps)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            yield
            self.cuda_peak = torch.cuda.max_memory_allocated()
            return
        with torch.profiler.record_function(MARK):
            yield

    def __exit__(self, *exc) -> None:
        if self.prof is not None:
            self.prof.__exit__(*exc)

    def peak_bytes(self) -> tuple[int, int]:
        """(peak inside the window, peak before it: model build and wrapping)."""
        if self.cuda:
            return self.cuda_peak, 0
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            self.prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        windows = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == MARK]
        start, end = min(w[0] for w in windows), max(w[1] for w in windows)
        memory = [(e["ts"], e["args"]["Total Allocated"]) for e in events
                  if e.get("name") == "[memory]"]
        inside = [v for t, v in memory if start <= t <= end]
        before = [v for t, v in memory if t < start]
        return max(inside, default=0), max(before, default=0)
