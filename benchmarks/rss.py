"""Peak resident memory of this process, resettable, so several frameworks can run in one process.

Linux keeps the peak RSS ("high water mark", VmHWM) per process and resets it to the current RSS
when "5" is written to /proc/self/clear_refs (Linux >= 4.0). Before each framework we free what the
previous one left (gc + glibc malloc_trim, so freed heap pages really leave the process), reset the
mark and note the baseline RSS; afterwards the peak minus the baseline is what that framework added.
"""
from __future__ import annotations

import ctypes
import gc
import re


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
