"""Run a function on N gloo ranks (one process each) and fail the test if any rank fails.

One launch per world size runs many checks: spawning a rank costs seconds (importing torch), so
tests group their cases into one worker function instead of launching per assertion.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, timeout_s: float, backend: str) -> None:
    # Every rank is a client of the store the parent hosts (TORCHELASTIC_USE_AGENT_STORE, as under
    # torchrun), so no rank's exit takes the store away from ranks still tearing down.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # Print before raising: mp.spawn shows only the first failing rank's traceback.
        print(f"[rank {rank}] failed:\n{traceback.format_exc()}", flush=True)
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 120.0,
                    backend: str = "gloo") -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; re-raise any rank's failure.

    The rendezvous store lives in this process, as torchrun's agent hosts it: when rank 0 hosted
    it and finished first, a rank still inside gloo's teardown could lose it and abort
    ("terminate called without an active exception"), failing a test whose checks all passed."""
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    try:
        mp.spawn(_entry, args=(world_size, port, fn, args, timeout_s, backend),
                 nprocs=world_size, join=True)
    finally:
        del store


def local_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share of a global batch (dim 0 split evenly)."""
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank:(rank + 1) * per_rank]


def global_mean(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()
