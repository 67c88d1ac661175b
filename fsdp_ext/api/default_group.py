"""What `fully_shard` and `FullyShardedDataParallel` do when no process group was given and none
is initialised: torch's behaviour under a launcher, and an announced single-process mode without one.

| situation                                   | torch                          | fsdp_ext               |
|---------------------------------------------|--------------------------------|------------------------|
| default group initialised                   | the world                      | the world              |
| none, launcher variables set (torchrun)     | fully_shard: init_process_group() from the environment; FSDP1: ValueError | the same |
| none, plain `python` (no launcher variables) | fully_shard: init's env:// error; FSDP1: ValueError | one process, nothing sharded: warned at the root's first forward and printed by describe() |

Why a single-process mode at all: a plain `python` run has one process, so a world-1 run is what a
sharded run would compute; it keeps notebooks and unit tests free of a process group, and it can
only start where no launcher exists, so it is never a silent replacement for a sharded run.
"""
from __future__ import annotations

import torch.distributed as dist

from .. import env

# torch's own message (torch.distributed.distributed_c10d._get_default_group), which FSDP1 raises.
NO_DEFAULT_GROUP = ("Default process group has not been initialized, please make sure to call "
                    "init_process_group.")


def ensure_for_fully_shard() -> None:
    """fully_shard with neither mesh nor process group: the default group, initialised from the
    launcher's environment as torch's fully_shard does (`init_process_group()`: its backend choice,
    its errors for incomplete variables). Without a launcher: nothing (the single-process mode)."""
    if dist.is_available() and not dist.is_initialized() and env.launched():
        dist.init_process_group()


def ensure_for_fsdp1() -> None:
    """FullyShardedDataParallel with no process group: torch's FSDP1 error under a launcher (it
    never initialises the group itself). Without a launcher: nothing (the single-process mode)."""
    if dist.is_available() and not dist.is_initialized() and env.launched():
        raise ValueError(NO_DEFAULT_GROUP)
