"""Free and refill the storages of gathered parameters and packed gradients, reusing host blocks.

A unit's gathered buffer is freed after each use by taking its storage down to zero bytes, and
refilled before the next, so that its views (and what autograd saved) stay valid. On CPU a refill
through the system allocator maps fresh pages for every block above glibc's mmap threshold (at
most 32 MiB): the kernel faults in and zeroes each page again, unit after unit. `fill` and `release`
go through a small cache of freed blocks instead (csrc/cpu/storage_cache.cpp: at most two per
size and twice the largest block in all), for CPU blocks of at least MIN_BYTES; anything else,
every build without the extension, and FSDP_EXT_STORAGE_CACHE=0 in the environment resize the
storage through the streams seam (streams.alloc_storage / free_storage) and use `torch.empty`.
Devices with side streams (CUDA) have their caching allocator, which the seam's rules are for.
"""
from __future__ import annotations


import torch

from ... import env, ops
from . import streams

if ops.HAVE_EXTENSION:
    from ... import _C

MIN_BYTES = 1 << 20  # below this glibc serves the block from its heap, no fresh pages
# Process-wide, as the cache is: FSDP_EXT_STORAGE_CACHE=0 turns it off (fsdp_ext/env.py, read
# once per process).
ENABLED = ops.HAVE_EXTENSION and env.process().storage_cache


def _cached(device: torch.device, nbytes: int) -> bool:
    return (ENABLED and device.type == "cpu" and nbytes >= MIN_BYTES
            and not streams.side_streams(device))


def fill(tensor: torch.Tensor) -> None:
    """Give the (empty) storage of `tensor` room for all its elements; contents undefined."""
    nbytes = tensor.numel() * tensor.element_size()
    if _cached(tensor.device, nbytes):
        _C.fill_storage(tensor, nbytes)
    else:
        streams.alloc_storage(tensor)


def release(tensor: torch.Tensor) -> None:
    """Free the storage of `tensor` (down to zero bytes); every tensor on it then holds no data."""
    if _cached(tensor.device, tensor.untyped_storage().nbytes()):
        _C.release_storage(tensor)
    else:
        streams.free_storage(tensor)


def empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty(numel), with the block taken from the cache where `fill` would take it from
    there. Give it back with `recycle` once nothing reads it (else it is freed as usual)."""
    if _cached(device, numel * dtype.itemsize):
        return _C.cached_empty(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=device)


def recycle(tensor: torch.Tensor) -> None:
    """Done with a buffer from `empty`: its block goes back to the cache if it came from there
    (every tensor on its storage then holds no data); otherwise nothing happens here."""
    if _cached(tensor.device, tensor.untyped_storage().nbytes()):
        release(tensor)


def cached_bytes() -> int:
    """Bytes of freed host blocks the cache holds for reuse."""
    if not ops.HAVE_EXTENSION:
        return 0
    return _C.cached_bytes()


def empty_cache() -> None:
    """Free the blocks the cache holds (e.g. after training, before something else needs memory)."""
    if ops.HAVE_EXTENSION:
        _C.empty_cache()
