"""The environment variables the runtime honours: read here only, once per `fully_shard` /
`FullyShardedDataParallel` call, into a frozen record its units keep (unit_config.py). A variable
changed later takes effect for units built later, never halfway through a model.

    FSDP_EXT_COLLECTIVE_TIMEOUT_S    bound on every wait on the runtime's collectives (comm.py;
                                     the fully_shard argument wins); 0 or "none": no bound
    FSDP_EXT_ISSUE_THREAD            "0": CPU all-gathers issued by the compute thread
    FSDP_EXT_DIRECT_MIN_NUMEL        fully_shard's split between direct and copied gathers
                                     (layout.py; the shard_module option wins)
    FSDP_EXT_CHECK_FINITE_GRADS      "1": check_finite_grads by default
    FSDP_EXT_CHECK                   collective tags: "on" (default), "sync", "off"
    FSDP_EXT_STORAGE_CACHE           "0": gathered and packed buffers resize without the block
                                     cache (process-wide: storage_cache.py)
    FSDP_EXT_SIDE_STREAM_DELAY_CYCLES  a test knob: cycles a side stream spins before each
                                     collective (CUDA; process-wide: streams.py)

Read elsewhere, process-wide, not through this record:

    FSDP_EXT_CPU_VECTOR              the CPU kernels' AVX2 paths: "auto" (default), "0" (scalar
                                     paths only), "1" (AVX2 and F16C required); read once by
                                     the extension (csrc/cpu_vector.h)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

TIMEOUT = "FSDP_EXT_COLLECTIVE_TIMEOUT_S"
ISSUE_THREAD = "FSDP_EXT_ISSUE_THREAD"
DIRECT_MIN_NUMEL = "FSDP_EXT_DIRECT_MIN_NUMEL"
CHECK_FINITE_GRADS = "FSDP_EXT_CHECK_FINITE_GRADS"
CHECK = "FSDP_EXT_CHECK"
STORAGE_CACHE = "FSDP_EXT_STORAGE_CACHE"
SIDE_STREAM_DELAY = "FSDP_EXT_SIDE_STREAM_DELAY_CYCLES"


@dataclass(frozen=True)
class Environment:
    collective_timeout: str | None = None   # as written; comm.collective_timeout parses it
    issue_thread: bool = True
    direct_min_numel: int | None = None
    check_finite_grads: bool = False
    check_mode: str = "on"                   # "on", "sync" or "off"
    storage_cache: bool = True
    side_stream_delay_cycles: int = 0


def read() -> Environment:
    """The variables as they are now."""
    get = os.environ.get
    check = get(CHECK, "on").lower()
    direct = get(DIRECT_MIN_NUMEL)
    return Environment(
        collective_timeout=get(TIMEOUT) or None,
        issue_thread=get(ISSUE_THREAD, "1") != "0",
        direct_min_numel=int(direct) if direct else None,
        check_finite_grads=get(CHECK_FINITE_GRADS, "0") not in ("", "0"),
        check_mode="off" if check in ("off", "0", "false") else "sync" if check == "sync" else "on",
        storage_cache=get(STORAGE_CACHE, "1") != "0",
        side_stream_delay_cycles=int(get(SIDE_STREAM_DELAY, "0") or 0))
