"""Launch N ranks as independent processes (subprocess.Popen), without killing survivors.

mp.spawn and torchrun tear down every rank as soon as one fails, which would hide a survivor that
hangs. Here each rank is its own process with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set as
torchrun sets them; the caller decides which ranks must exit and within how long, and whatever is
still running at the end is killed (and reported as such).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class RankResult:
    rank: int
    returncode: int | None   # None: still running at the deadline (killed by us)
    seconds: float           # from launch to exit (or to the deadline)
    output: str              # stdout and stderr together


# What torchrun sets in each rank's environment: stripped from a child that must start as a user's
# fresh `python` or `torchrun` command would (a launcher around pytest must not leak into it).
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK")


def environment_without_launcher(*also: str) -> dict[str, str]:
    """This process's environment less the launcher's variables (and `also`)."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES + also}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """`with Ranks(args, world) as ranks: results = ranks.wait(...)`; kills leftovers on exit."""

    def __init__(self, args: list[str], world_size: int, env: dict[str, str] | None = None):
        port = str(free_port())
        self.start = time.monotonic()
        self.procs, self.logs = [], []
        for rank in range(world_size):
            log = tempfile.TemporaryFile(mode="w+")
            rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
            self.procs.append(subprocess.Popen([sys.executable, *args], env=rank_env, cwd=REPO,
                                               stdout=log, stderr=subprocess.STDOUT))
            self.logs.append(log)

    def wait(self, ranks, deadline_s: float) -> dict[int, RankResult]:
        """Wait until every rank in `ranks` exited or `deadline_s` passed since launch."""
        results = {}
        for rank in ranks:
            left = max(0.0, deadline_s - (time.monotonic() - self.start))
            try:
                code = self.procs[rank].wait(timeout=left)
            except subprocess.TimeoutExpired:
                code = None
            results[rank] = RankResult(rank, code, time.monotonic() - self.start, self.output(rank))
        return results

    def output(self, rank: int) -> str:
        log = self.logs[rank]
        log.flush()
        log.seek(0)
        return log.read()

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
