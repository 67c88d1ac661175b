"""CPU offload: sharded parameters, gradients and optimizer state live in host memory.

The optimizer steps on the host. Per unit, the shard is copied to the compute device just before
its all-gather (into a staging buffer, then the usual cast-into-slot), and each reduced gradient
shard is copied back to the host before the epilogue accumulates it. Host buffers are pinned when a
GPU is present so both copies can run asynchronously. With a CPU compute device the copies are real
host-to-host copies, so the same code path runs (and is tested) on machines without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """FSDP2-style offload policy. pin_memory: page-lock host shards for async copies."""

    pin_memory: bool = True


def host_empty(numel: int, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    pin = pin_memory and torch.cuda.is_available()
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)


def to_compute_device(shard: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of a host shard on the compute device (a fresh buffer even when that is the CPU)."""
    staged = torch.empty(shard.shape, dtype=shard.dtype, device=device)
    staged.copy_(shard, non_blocking=shard.is_pinned())
    return staged


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a reduced gradient shard; blocking, since the host epilogue reads it next."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    host.copy_(tensor)
    return host
