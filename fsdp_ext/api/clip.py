"""Gradient norm and clipping over sharded gradients.

Each rank holds 1/shard_size of every gradient, so the global 2-norm is the square root of the sum,
over the shard group, of each rank's local sum of squares; the inf-norm is the max of local maxima.
Replicas (HSDP, NO_SHARD) hold identical shards and are not summed again. Every rank gets the same
value, equal to torch.nn.utils.clip_grad_norm_ on the unwrapped model.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import dtensor_params
from ..runtime.errors import NonFiniteGradientError
from ..runtime.registry import units_of


def _local_norm_terms(unit, norm_type: float) -> torch.Tensor:
    """This rank's contribution for one unit: sum of |g|^p, or max |g| for p = inf (fp32), on the
    unit's compute device: offloaded gradients live on the host, but the all-reduce (NCCL on a
    GPU) takes tensors of the process group's device."""
    grads = _local_grads([unit])
    device = unit.groups.device
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, norm_type)
    stacked = torch.stack([n.float() for n in norms])
    if math.isinf(norm_type):
        return stacked.max().to(device)
    return (stacked ** norm_type).sum().to(device)


def _local_grads(units) -> list[torch.Tensor]:
    """This rank's part of every gradient (a DTensor's local tensor), empty ones left out."""
    grads = [dtensor_params.local_of(slot.param.grad) for unit in units
             for bucket in unit.buckets for slot in bucket.slots if slot.param.grad is not None]
    return [g for g in grads if g.numel()]


def _reduce(value: torch.Tensor, group, norm_type: float) -> torch.Tensor:
    if group is not None:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(value, op=op, group=group)
    return value


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
    # Units normally share one shard group; sum per group so mixed groupings stay correct.
    per_group: dict[int, tuple] = {}
    per_unit: list[torch.Tensor] = []
    for unit in units:
        term = _local_norm_terms(unit, norm_type)
        per_unit.append(term)
        key = id(unit.groups.shard)
        group_total = per_group.get(key, (unit.groups.shard, None))[1]
        if group_total is None:
            group_total = term.clone()
        elif math.isinf(norm_type):
            group_total = torch.maximum(group_total, term)
        else:
            group_total = group_total + term
        per_group[key] = (unit.groups.shard, group_total)
    totals = [_reduce(total, group, norm_type) for group, total in per_group.values()]
    if math.isinf(norm_type):
        total_norm = torch.stack(totals).max()
    else:
        total_norm = torch.stack(totals).sum() ** (1.0 / norm_type)
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
    """Name every unit whose gradient is not finite on some rank (all ranks agree on the list)."""
    flags = torch.tensor([0.0 if torch.isfinite(t) else 1.0 for t in per_unit])
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad = [u.name or "<root>" for u, f in zip(units, flags.tolist()) if f]
    return (f"the total {norm_type}-norm of the gradients is {total_norm.item()}; non-finite "
            f"gradients in unit(s): {', '.join(bad)}")
