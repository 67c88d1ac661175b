"""`summon_full_params`: full-shape, full-precision parameters in place, for inspection or editing.

Inside the block every sharded parameter has its full shape and value (FullyShardedDataParallel's
are the same objects the optimizer holds; fully_shard's DTensor parameters are replaced by full
ones for the block); with `writeback=True` edits are copied back into this rank's shard on exit.
Every rank must enter it (it all-gathers). It holds every unit unsharded at once, so use it on
models that fit, as with FSDP1's `summon_full_params`, whose options it takes with their meaning:
`recurse=False` only the units whose module is `model` (or, when `model` is not a unit, the
outermost units under it); `rank0_only` only global rank 0 gets full parameters (the others keep
their shards; writeback must then be False); `offload_to_cpu` the full parameters live on the
CPU; `with_grads` the gradients are gathered too (and written back with the parameters).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.core.registry import unit_of, units_of
from ..runtime.unit.unit import ensure_root
from .state_dict import gather_bucket


def _units(model: nn.Module, recurse: bool) -> list:
    units = units_of(model)
    if recurse or not units:
        return units
    if unit_of(model) is not None:
        return [unit_of(model)]
    outer, inner = [], set()
    for unit in units:  # units_of lists parents before their children
        if id(unit) not in inner:
            outer.append(unit)
            inner.update(id(u) for member in unit.members for u in units_of(member)
                         if u is not unit)
    return outer


@contextlib.contextmanager
def summon_full_params(model: nn.Module, recurse: bool = True, writeback: bool = True,
                       rank0_only: bool = False, offload_to_cpu: bool = False,
                       with_grads: bool = False):
    if rank0_only and writeback:
        raise NotImplementedError(
            "summon_full_params(rank0_only=True, writeback=True): the other ranks keep their "
            "shards, so their edits could not be written back consistently (torch refuses it too)")
    if with_grads and offload_to_cpu:
        raise NotImplementedError(
            "summon_full_params(with_grads=True, offload_to_cpu=True) is not supported (as in torch)")
    installs = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    for unit in _units(model, recurse=False):
        ensure_root(unit)
    gathered = []
    with torch.no_grad():
        for unit in _units(model, recurse):
            unit.wait_unshard()
            for bucket in unit.buckets:
                for slot in bucket.slots:
                    slot.placement.require_whole(lambda: NotImplementedError(
                        f"summon_full_params: unit '{unit.name or '<root>'}' holds tensor-parallel "
                        "parameters; use DTensor.full_tensor() on them instead"))
                tensors = gather_bucket(unit, bucket, bucket.shard)
                grads = _gather_grads(unit, bucket) if with_grads else None
                if offload_to_cpu:
                    tensors = [t.cpu() for t in tensors]
                if installs:
                    _install(unit, bucket, tensors, grads)
                gathered.append((unit, bucket, tensors, grads))
            if installs:
                unit.enter_summon()
    try:
        yield
    finally:
        with torch.no_grad():
            for unit, bucket, tensors, grads in gathered:
                if writeback and installs:
                    _write_back(bucket, tensors, grads)
                bucket.point_params_at_shard()
                unit.params.install_sharded()
                if grads is not None:
                    for index in range(len(bucket.slots)):
                        if grads[index] is not None:
                            bucket.publish_grad(index)
                unit.leave_summon()


def _gather_grads(unit, bucket) -> list[torch.Tensor | None] | None:
    """Full-shape gradients of the bucket (None for parameters without one), or None if no
    parameter has a gradient. Every rank takes part whenever any does (grads exist alike)."""
    has = [slot.param.grad is not None for slot in bucket.slots]
    if not any(has):
        return None
    bucket.sync_param_grads_into_buffer()
    full = gather_bucket(unit, bucket, bucket.grad_shard)
    return [g if h else None for g, h in zip(full, has)]


def _install(unit, bucket, tensors, grads) -> None:
    if bucket.distributed:  # a DTensor parameter cannot take a full tensor's data
        for index, (slot, tensor) in enumerate(zip(bucket.slots, tensors)):
            param = nn.Parameter(tensor, requires_grad=slot.param.requires_grad)
            param.grad = grads[index] if grads is not None else None
            unit.params.install_full(slot, param)
        return
    bucket.point_params_at(tensors)  # the user's parameter objects, their .data the full tensors
    if grads is not None:
        bucket.set_param_grads(grads)
    for slot in bucket.slots:
        unit.params.install_full(slot, slot.param)


def _write_back(bucket, tensors, grads) -> None:
    """Copy this rank's part of each (possibly edited) full parameter, and gradient, back."""
    layout = bucket.layout
    for index, (slot, view) in enumerate(zip(bucket.slots, bucket.shard_views)):
        module, attr = slot.locations[0]
        full = module._parameters[attr] if bucket.distributed else tensors[index]
        view.view(-1).copy_(layout.local_part(index, full).reshape(-1))
        if grads is not None and grads[index] is not None:
            grad = full.grad if bucket.distributed else slot.param.grad
            if grad is not None:
                bucket.grad_views[index].view(-1).copy_(layout.local_part(index, grad).reshape(-1))
