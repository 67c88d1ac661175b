"""What the benchmarks share: launching ranks, the machine line, markdown tables and result files.

Every benchmark runs from the top of the checkout as a module,
`python -m benchmarks.<folder>.<name>`, and writes its markdown and JSON under RESULTS
(benchmarks/results/) unless told otherwise.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ---- launching ranks -----------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker, world_size: int, *args) -> None:
    """`worker(rank, world_size, port, *args)` on `world_size` spawned processes, a fresh
    rendezvous port for them; returns when all have ended."""
    mp.spawn(worker, args=(world_size, free_port(), *args), nprocs=world_size, join=True)


def init_rank(rank: int, world_size: int, port: int, *, threads: int = 1,
              timeout_s: float | None = None, backend: str = "gloo", **env: str) -> None:
    """This process as `rank` of a launch: the rendezvous address (and any further environment
    variables in `env`), `threads` torch threads, the process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    torch.set_num_threads(threads)
    timeout = {} if timeout_s is None else dict(timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(backend, rank=rank, world_size=world_size, **timeout)


# ---- where it ran --------------------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine() -> dict:
    """What ran the benchmark, and how busy it was (other jobs share these cores)."""
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        uptime = ""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return dict(cpu=cpu_model(), cores=os.cpu_count(), mem_gib=round(mem_gib, 1),
                torch=torch.__version__, python=platform.python_version(),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                loadavg=os.getloadavg(), uptime=uptime)


def machine_line(m: dict) -> str:
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    load = ", ".join(f"{x:.2f}" for x in m["loadavg"])
    return (f"{m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB{gpu}; torch {m['torch']}; "
            f"load average {load}")


def command(module: str, argv: list[str] | None = None) -> str:
    """The command line that ran `module` (its dotted name) with this process's arguments, as a
    report records it."""
    return " ".join(["python -m", module, *(sys.argv if argv is None else argv)[1:]])


# ---- results -------------------------------------------------------------------------------------

def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def write_results(out: str, stem: str, text: str, data: dict) -> None:
    """`text` to out/STEM.md and `data` to out/STEM.json."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(text)
    write_json(os.path.join(out, stem + ".json"), data)


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.0f}"
