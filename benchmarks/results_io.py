"""Shared output helpers for the benchmarks: machine description, markdown tables, JSON."""
from __future__ import annotations

import json
import os
import platform
import subprocess

import torch


def machine() -> dict:
    """What ran the benchmark, and how busy it was (other jobs share these cores)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        uptime = ""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return dict(cpu=cpu, cores=os.cpu_count(), mem_gib=round(mem_gib, 1),
                torch=torch.__version__, python=platform.python_version(),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                loadavg=os.getloadavg(), uptime=uptime)


def machine_line(m: dict) -> str:
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    load = ", ".join(f"{x:.2f}" for x in m["loadavg"])
    return (f"{m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB{gpu}; torch {m['torch']}; "
            f"load average {load}")


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.0f}"
