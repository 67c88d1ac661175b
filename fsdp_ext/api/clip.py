"""Gradient norm and clipping over sharded gradients.

Each rank holds 1/shard_size of every gradient, so the global 2-norm is the square root of the sum,
over the shard group, of each rank's local sum of squares; the inf-norm is the max of local maxima.
Replicas (HSDP, NO_SHARD) hold identical shards and are not summed again; tensor-parallel shards
are summed over their TP mesh too, TP-replicated gradients are not. Every rank gets the same value,
equal to torch.nn.utils.clip_grad_norm_ on the unwrapped model (which, on DTensor gradients of one
mesh, gives the same; torch's cannot mix the meshes of FSDP and FSDP x TP parameters).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.placement import dtensor_params
from ..runtime.core import streams
from ..runtime.core.errors import NonFiniteGradientError
from ..runtime.core.registry import units_of


def _reduction_groups(bucket, slot) -> tuple:
    """Over which process groups this rank's part of `slot`'s gradient must be summed: its
    bucket's shard group (the unit's, or its own mesh's), and a tensor-parallel mesh's group
    where TP shards the parameter too (a TP-replicated parameter's gradient is the same on every
    TP rank: counted once)."""
    groups = (bucket.groups.shard,)
    return groups + slot.placement.norm_groups()


def _local_norm_terms(unit, norm_type: float) -> dict[tuple, tuple[tuple, torch.Tensor]]:
    """This rank's contributions for one unit, per set of groups to reduce over: sum of |g|^p,
    or max |g| for p = inf (fp32), where the gradients are (offloaded ones on the host:
    _to_device moves them, all units' at once)."""
    by_groups: dict[tuple, tuple[tuple, list]] = {}
    for bucket in unit.buckets:  # every parameter's key, gradient or not: the same on all ranks
        for slot in bucket.slots:
            groups = _reduction_groups(bucket, slot)
            grads = by_groups.setdefault(tuple(id(g) for g in groups), (groups, []))[1]
            if slot.param.grad is not None and dtensor_params.local_of(slot.param.grad).numel():
                grads.append(dtensor_params.local_of(slot.param.grad))
    terms = {}
    for key, (groups, grads) in by_groups.items():
        # where the gradients are: an offloaded unit without gradients is staged with the others
        term = torch.zeros((), dtype=torch.float32,
                           device="cpu" if unit.offload is not None else unit.groups.device)
        if grads:
            stacked = torch.stack([n.float() for n in torch._foreach_norm(grads, norm_type)])
            term = (stacked.max() if math.isinf(norm_type) else (stacked ** norm_type).sum())
        terms[key] = (groups, term)
    return terms


def _to_device(terms: list[torch.Tensor], on_host: list[bool],
               device: torch.device) -> list[torch.Tensor]:
    """`terms` on `device`, where the all-reduce (NCCL on a GPU) needs them: those computed on
    the host (`on_host`: CPU offload) travel in one copy from pinned memory that does not block
    the host, instead of one blocking copy each."""
    away = [i for i, host in enumerate(on_host) if host]
    if not away:
        return terms
    staged = streams.host_empty(len(away), torch.float32, pin=streams.side_streams(device))
    torch.stack([terms[i].float() for i in away], out=staged)
    moved = staged.to(device, non_blocking=True)
    out = list(terms)
    for j, i in enumerate(away):
        out[i] = moved[j]
    return out


def _local_grads(units) -> list[torch.Tensor]:
    """This rank's part of every gradient (a DTensor's local tensor), empty ones left out."""
    grads = [dtensor_params.local_of(slot.param.grad) for unit in units
             for bucket in unit.buckets for slot in bucket.slots if slot.param.grad is not None]
    return [g for g in grads if g.numel()]


def _combine(a: torch.Tensor | None, b: torch.Tensor, norm_type: float) -> torch.Tensor:
    if a is None:
        return b.clone()
    return torch.maximum(a, b) if math.isinf(norm_type) else a + b


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of every sharded parameter of `model` in place; return the global norm.

    Every rank must call it (it all-reduces). With `error_if_nonfinite`, a NaN/Inf norm raises
    NonFiniteGradientError naming the units whose gradients are not finite (on any rank).
    """
    norm_type = float(norm_type)
    units = units_of(model)
    if not units:
        raise ValueError(f"{type(model).__name__} has no fully_shard units")
    # Units normally share one shard group; sum per set of groups so mixed groupings stay right.
    device = units[0].groups.device
    found = [(unit, key, groups, term) for unit in units
             for key, (groups, term) in _local_norm_terms(unit, norm_type).items()]
    moved = _to_device([term for *_, term in found],
                       [unit.offload is not None for unit, *_ in found], device)
    totals: dict[tuple, tuple[tuple, torch.Tensor]] = {}
    by_unit: dict[int, torch.Tensor] = {}
    for (unit, key, groups, _), term in zip(found, moved):
        totals[key] = (groups, _combine(totals.get(key, (None, None))[1], term, norm_type))
        by_unit[id(unit)] = _combine(by_unit.get(id(unit)), term, norm_type)
    per_unit = [by_unit.get(id(unit)) for unit in units]
    reduced = []
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    for groups, total in sorted(totals.values(), key=lambda item: len(item[0])):
        for group in groups:
            if group is not None:
                dist.all_reduce(total, op=op, group=group)
        reduced.append(total)
    if not reduced:
        total_norm = torch.zeros((), dtype=torch.float32, device=device)
    elif math.isinf(norm_type):
        total_norm = torch.stack(reduced).max()
    else:
        total_norm = torch.stack(reduced).sum() ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise NonFiniteGradientError(_nonfinite_report(units, per_unit, norm_type, total_norm))
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    grads = _local_grads(units)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), group in by_kind.items():
        torch._foreach_mul_(group, clip_coef.to(device=device, dtype=dtype))
    return total_norm


def _nonfinite_report(units, per_unit, norm_type, total_norm) -> str:
    """Name every unit whose gradient is not finite on some rank (all ranks agree on the list).

    The flags are exchanged over the units' own groups, on their device, as the norm was: the
    ranks that reach this point are exactly those that reduced the non-finite norm (a default
    group could hold others that never call it, and an NCCL group cannot reduce a host tensor)."""
    device = units[0].groups.device
    flags = torch.stack([torch.zeros((), device=device) if t is None
                         else (~torch.isfinite(t)).to(device=device, dtype=torch.float32)
                         for t in per_unit])
    groups = {id(g): g for u in units for g in (u.groups.shard, u.groups.replicate)
              if g is not None}
    for group in groups.values():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    bad = [u.name or "<root>" for u, f in zip(units, flags.tolist()) if f]
    return (f"the total {norm_type}-norm of the gradients is {total_norm.item()}; non-finite "
            f"gradients in unit(s): {', '.join(bad)}")
