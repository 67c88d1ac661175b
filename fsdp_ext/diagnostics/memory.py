"""The runtime's own account of the bytes it holds on this rank, read from the units' buckets.

    params:     the sharded parameter storage (bucket.shard), padding included
    grads:      the sharded gradient storage (bucket.grad_shard), once a backward created it
    optimizer:  every tensor in optimizer.state (AdamW: exp_avg, exp_avg_sq, step), by storage
    unsharded:  gathered `full` buffers allocated right now (0 between steps; the root and the
                last unit stay allocated from forward to backward)

`cached` is what the host block cache (storage_cache.py) holds for the next refill: freed
gathered or packed-gradient blocks, at most two per size and twice the largest block in all,
process-wide (not in `total`).
`unsharded_unit_max` is the largest single unit's gathered size, so a caller can bound what the
prefetch depth adds (depth + 1 transient units plus the root). Process RSS also holds activations,
the allocator's free lists and the libraries; this report is what sharding controls.
"""
from __future__ import annotations

import torch
from torch import nn

from ..runtime.placement import dtensor_params
from ..runtime.core import storage_cache
from ..runtime.core.registry import units_of


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = dtensor_params.local_of(t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return _storage_bytes(v for state in optimizer.state.values() for v in state.values())


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes this rank holds for `model`'s sharded units and `optimizer`, by category.

    Args:
        model: a module sharded with fully_shard / FullyShardedDataParallel (or containing units).
        optimizer: the optimizer over its parameters (optional).
    Returns:
        dict with params, grads, optimizer, unsharded, total, cached, unsharded_unit_max (bytes)
        and units.
    """
    units = units_of(model)
    params = grads = unsharded = unit_max = 0
    for unit in units:
        unit_full = 0
        for bucket, full in ((b, b.full_data) for b in unit.buckets):
            params += bucket.sharded_bytes()
            if bucket.grad_shard is not None:
                grads += bucket.grad_shard.untyped_storage().nbytes()
            unsharded += full.untyped_storage().nbytes()
            unit_full += full.numel() * full.element_size()
        unit_max = max(unit_max, unit_full)
    report = dict(params=params, grads=grads, optimizer=optimizer_state_bytes(optimizer),
                  unsharded=unsharded)
    report["total"] = sum(report.values())
    report.update(cached=storage_cache.cached_bytes(), unsharded_unit_max=unit_max, units=len(units))
    return report
