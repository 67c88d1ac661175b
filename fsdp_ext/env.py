"""Every environment variable fsdp_ext reads, read here only (tests/project/test_layering.py checks).

Per call: read once per `fully_shard` / `FullyShardedDataParallel` call into a frozen record its
units keep (runtime/unit/config.py). A variable changed later takes effect for units built later,
never halfway through a model.

    FSDP_EXT_COLLECTIVE_TIMEOUT_S    bound on every wait on the runtime's collectives
                                     (runtime/comm/collectives.py; the fully_shard argument
                                     wins); 0 or "none": no bound
    FSDP_EXT_ISSUE_THREAD            "0": CPU all-gathers issued by the compute thread
    FSDP_EXT_DIRECT_MIN_NUMEL        fully_shard's split between direct and copied gathers
                                     (runtime/bucket/layout.py; the shard_module option wins)
    FSDP_EXT_CHECK_FINITE_GRADS      "1": check_finite_grads by default
    FSDP_EXT_CHECK                   collective tags: "on" (default), "sync", "off"

Per process: what one process has one of, read once, at its first use, and never set by a call
(`process()`): set them before the process starts.

    FSDP_EXT_STORAGE_CACHE           "0": gathered and packed buffers resize without the block
                                     cache (runtime/core/storage_cache.py)
    FSDP_EXT_SIDE_STREAM_DELAY_CYCLES  a test knob: cycles a side stream spins before each
                                     collective (CUDA; runtime/core/streams.py)
    FSDP_EXT_BACKEND                 the kernels' backend for every op called without one
                                     ("cpp", "cuda", "triton", "torch"; ops/__init__.py)

The launcher's (torchrun's), read as torch reads them: `launched()` (any of RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, TORCHELASTIC_RUN_ID: api/default_group.py) and `local_world_size()`
(LOCAL_WORLD_SIZE: FSDP1's HYBRID_SHARD node size).

Read by the compiled extension itself, once: FSDP_EXT_CPU_VECTOR, the CPU kernels' AVX2 paths:
"auto" (default), "0" (scalar paths only), "1" (AVX2 and F16C required; csrc/cpu_vector.h).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

TIMEOUT = "FSDP_EXT_COLLECTIVE_TIMEOUT_S"
ISSUE_THREAD = "FSDP_EXT_ISSUE_THREAD"
DIRECT_MIN_NUMEL = "FSDP_EXT_DIRECT_MIN_NUMEL"
CHECK_FINITE_GRADS = "FSDP_EXT_CHECK_FINITE_GRADS"
CHECK = "FSDP_EXT_CHECK"
STORAGE_CACHE = "FSDP_EXT_STORAGE_CACHE"
SIDE_STREAM_DELAY = "FSDP_EXT_SIDE_STREAM_DELAY_CYCLES"
BACKEND = "FSDP_EXT_BACKEND"
# Set by torchrun (and by torch.distributed.launch, mpirun wrappers that export them, SLURM scripts
# written for env:// rendezvous): any of them means more than one process may be running.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class Environment:
    """The per-call variables."""

    collective_timeout: str | None = None   # as written; comm.collective_timeout parses it
    issue_thread: bool = True
    direct_min_numel: int | None = None
    check_finite_grads: bool = False
    check_mode: str = "on"                   # "on", "sync" or "off"


@dataclass(frozen=True)
class ProcessEnvironment:
    """The per-process variables."""

    storage_cache: bool = True
    side_stream_delay_cycles: int = 0
    backend: str | None = None


def read() -> Environment:
    """The per-call variables as they are now."""
    get = os.environ.get
    check = get(CHECK, "on").lower()
    direct = get(DIRECT_MIN_NUMEL)
    return Environment(
        collective_timeout=get(TIMEOUT) or None,
        issue_thread=get(ISSUE_THREAD, "1") != "0",
        direct_min_numel=int(direct) if direct else None,
        check_finite_grads=get(CHECK_FINITE_GRADS, "0") not in ("", "0"),
        check_mode="off" if check in ("off", "0", "false") else "sync" if check == "sync" else "on")


@functools.cache
def process() -> ProcessEnvironment:
    """The per-process variables, as they were at the first call."""
    get = os.environ.get
    return ProcessEnvironment(
        storage_cache=get(STORAGE_CACHE, "1") != "0",
        side_stream_delay_cycles=int(get(SIDE_STREAM_DELAY, "0") or 0),
        backend=get(BACKEND) or None)


def launched() -> bool:
    """True when a launcher's variables are in the environment."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def local_world_size(default: int) -> int:
    """The launcher's LOCAL_WORLD_SIZE (ranks per node), else `default`."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))
