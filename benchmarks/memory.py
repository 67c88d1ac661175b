"""Memory the benchmarks measure: a process's peak resident memory, resettable, and the peak bytes
of its live tensors.

Peak RSS. Linux keeps the peak RSS ("high water mark", VmHWM) per process and resets it to the
current RSS when "5" is written to /proc/self/clear_refs (Linux >= 4.0), so several frameworks can
run in one process. Before each framework we free what the previous one left (gc + glibc
malloc_trim, so freed heap pages really leave the process), reset the mark and note the baseline
RSS; afterwards the peak minus the baseline is what that framework added.

Peak tensors (TensorMemory), from the profiler's allocator events (independent of malloc). Process
RSS also counts what glibc keeps after a free, imported libraries and thread stacks; on these
machines that moves a framework's peak by tens of MB either way. PyTorch's CPU allocator, while the
profiler runs with profile_memory=True, reports every allocation and free together with the running
total of the bytes it allocated since profiling began ("Total Allocated" of each "[memory]" event).
Profiling from before the model exists therefore gives the exact live tensor bytes at every
allocation; the peak inside a marked window is the framework's tensor peak. Allocations made by
threads the profiler does not follow (gloo's workers) are not in the total, and neither are their
frees.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import re
import tempfile

import torch


# ---- peak RSS ------------------------------------------------------------------------------------

def track_live_memory() -> None:
    """Make RSS follow the live tensors: glibc otherwise raises its mmap threshold (up to 32 MB)
    after the first large free, so later multi-MB tensors come from the heap and their pages stay
    resident after they die; RSS then shows allocator history rather than what a framework holds.
    A fixed 64 KiB threshold (mallopt M_MMAP_THRESHOLD) maps every tensor above it separately and
    gives it back on free. Call once per process, before the model exists; the same for every
    framework."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD: give back free heap tops promptly too
    except (OSError, AttributeError):
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(match.group(1)) if match else 0


def current_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def release_free_memory() -> None:
    """Return freed heap memory to the OS (glibc keeps it otherwise and RSS would not drop)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: RSS may stay higher, the reset below still works
        pass


def reset_peak() -> bool:
    """Start a new peak window at the current RSS; False where the kernel does not allow it."""
    release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def save_largest_peak_and_exit(build, steps: int, path: str) -> None:
    """A memory worker's whole run, after its libraries are loaded: the peak RSS above this
    process's baseline while `build()` makes a trainer and `steps` of its `step()` run; rank 0
    saves the largest rank's to `path`, then the process group goes and the process ends."""
    import torch.distributed as dist

    from fsdp_ext import exit_without_finalization
    reset_peak()
    base = current_bytes()
    trainer = build()
    for _ in range(steps):
        trainer.step()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_bytes() - base)
    if dist.get_rank() == 0:
        torch.save(max(peaks), path)
    dist.destroy_process_group()
    exit_without_finalization()


# ---- peak tensors --------------------------------------------------------------------------------

MARK = "bench::window"


class TensorMemory:
    """Peak bytes of live tensors inside a window: on CPU from the profiler's allocator events, on
    CUDA from the caching allocator's peak statistics."""

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
