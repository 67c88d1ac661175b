"""Run a function on N gloo ranks (one process each) and fail the test if any rank fails.

One launch per world size runs many checks: spawning a rank costs seconds (importing torch), so
tests group their cases into one worker function instead of launching per assertion.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_ext import exit_without_finalization


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, timeout_s: float, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    faulthandler.enable()  # a rank that crashes (a signal) prints every thread's Python stack
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
    exit_without_finalization()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 120.0,
                    backend: str = "gloo") -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; re-raise any rank's failure."""
    mp.spawn(_entry, args=(world_size, _free_port(), fn, args, timeout_s, backend),
             nprocs=world_size, join=True)


def local_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share of a global batch (dim 0 split evenly)."""
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank:(rank + 1) * per_rank]


def global_mean(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def on_world_and_last_two(check, rank: int, world_size: int, *args) -> None:
    """check(group, group_rank, group_size, *args) over the world, then over a subgroup of the
    last two ranks (on its members), where group ranks differ from global ones."""
    check(dist.group.WORLD, rank, world_size, *args)
    members = [world_size - 2, world_size - 1]
    group = dist.new_group(members)
    if rank in members:
        check(group, members.index(rank), 2, *args)


def run_checks(checks, rank: int, world: int) -> None:
    """Run each `check(rank, world)` in turn, all ranks together (a barrier after each); a failure
    names the check and the world size."""
    for check in checks:
        try:
            check(rank, world)
        except BaseException as exc:
            raise AssertionError(f"{check.__name__} (world {world}): {exc}") from exc
        dist.barrier()
