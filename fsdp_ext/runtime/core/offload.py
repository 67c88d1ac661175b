"""CPU offload: sharded parameters, gradients and optimizer state live in host memory.

The optimizer steps on the host. Per unit, the shard is copied to the compute device just before
its all-gather (into a staging buffer, then the usual cast-into-slot), and each reduced gradient
shard is copied back to the host before the epilogue accumulates it there.

With side streams (a GPU) host buffers are pinned and both copies are asynchronous, each queued on
the collective's stream: host -> device before the all-gather, device -> host right after the
reduce-scatter, after which the host waits for that stream's event before its epilogue reads the
copy. With a CPU compute device the copies are plain host-to-host copies (made after the gloo
reduction was waited for), so the same code path runs, and is tested, on machines without a GPU.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy  # noqa: F401  (torch's; pin_memory is read)

from . import streams


def host_empty(numel: int, dtype: torch.dtype, pin_memory: bool, device: torch.device) -> torch.Tensor:
    """A host buffer for a unit computing on `device`; pinned when asked and `device` has side
    streams (page-locking needs an accelerator, and only asynchronous copies gain from it)."""
    return streams.host_empty(numel, dtype, pin_memory and streams.side_streams(device))


def to_compute_device(shard: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of a host shard on the compute device (a fresh buffer even when that is the CPU);
    with side streams queued on the current (all-gather) stream without blocking the host, which
    then must not write the shard before that stream got past the copy."""
    staged = torch.empty(shard.shape, dtype=shard.dtype, device=device)
    staged.copy_(shard, non_blocking=streams.side_streams(device))
    return staged


def copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Queue a copy of a reduced gradient shard into pinned host memory on the current stream;
    the host must wait for that stream (streams.synchronize) before reading it."""
    host = streams.host_empty(tensor.shape, tensor.dtype, True)
    host.copy_(tensor, non_blocking=True)
    return host


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a reduced gradient shard, made now (the CPU path, after the gloo wait)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    host.copy_(tensor)
    return host
