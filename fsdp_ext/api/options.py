"""torch's own option objects, read by meaning.

fsdp_ext exports torch's enums and dataclasses themselves (`ShardingStrategy`, `BackwardPrefetch`,
`MixedPrecision`, `CPUOffload`, `MixedPrecisionPolicy`, `OffloadPolicy`, `CPUOffloadPolicy`, the
state-dict types and configs), so a script passes the same objects whichever package it imported
them from. Each reader below takes one of them (or None where torch allows it), returns what the
runtime needs, and raises at the call for anything else: a look-alike enum from another package is
matched by its member's name, and an option fsdp_ext cannot honour is refused naming it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, CPUOffloadPolicy, MixedPrecision,
                                    MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy)


def _member(value, enum_type: type[enum.Enum], argument: str):
    """torch's member of `enum_type` named like `value` (a member of torch's enum, or of a copy of
    it with the same member names); TypeError for anything else."""
    if isinstance(value, enum_type):
        return value
    name = getattr(value, "name", None)
    if isinstance(value, enum.Enum) and name in enum_type.__members__:
        return enum_type[name]
    raise TypeError(f"{argument} must be a torch.distributed.fsdp.{enum_type.__name__} member "
                    f"({', '.join(enum_type.__members__)}), got {value!r}")


@dataclass(frozen=True)
class Strategy:
    """What a ShardingStrategy means for the runtime."""

    shard: bool                # False: NO_SHARD (every rank holds everything, gradients all-reduced)
    reshard_after_forward: bool
    hybrid: bool               # shard within a node, replicate across nodes


_STRATEGIES = {
    "FULL_SHARD": Strategy(True, True, False),
    "SHARD_GRAD_OP": Strategy(True, False, False),
    "NO_SHARD": Strategy(False, False, False),
    "HYBRID_SHARD": Strategy(True, True, True),
    "_HYBRID_SHARD_ZERO2": Strategy(True, False, True),
}


def sharding_strategy(value) -> Strategy:
    member = _member(ShardingStrategy.FULL_SHARD if value is None else value, ShardingStrategy,
                     "sharding_strategy")
    return _STRATEGIES[member.name]


def backward_prefetch(value) -> str | None:
    """None (no backward prefetch), "pre" (BACKWARD_PRE) or "post" (BACKWARD_POST)."""
    if value is None:
        return None
    return {"BACKWARD_PRE": "pre", "BACKWARD_POST": "post"}[
        _member(value, BackwardPrefetch, "backward_prefetch").name]


def cpu_offload(value) -> CPUOffloadPolicy | None:
    """FSDP1's CPUOffload(offload_params=...) as the runtime's offload policy."""
    if value is None:
        return None
    if not isinstance(value, CPUOffload):
        raise TypeError(f"cpu_offload must be a torch.distributed.fsdp.CPUOffload, got {value!r}")
    return CPUOffloadPolicy() if value.offload_params else None


def offload_policy(value) -> CPUOffloadPolicy | None:
    """FSDP2's offload_policy: OffloadPolicy() (torch's default) means none."""
    if value is None or type(value) is OffloadPolicy:
        return None
    if isinstance(value, CPUOffloadPolicy):
        return value
    raise TypeError("offload_policy must be torch.distributed.fsdp.OffloadPolicy() or "
                    f"CPUOffloadPolicy(...), got {value!r}")


def mp_policy(value) -> MixedPrecisionPolicy:
    if value is None:
        return MixedPrecisionPolicy()
    if not isinstance(value, MixedPrecisionPolicy):
        raise TypeError("mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                        f"{value!r}")
    return value


def mixed_precision(value, is_root: bool) -> MixedPrecisionPolicy:
    """FSDP1's MixedPrecision for one unit (cast_root_forward_inputs applies to the root only)."""
    if value is None:
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    if not isinstance(value, MixedPrecision):
        raise TypeError("mixed_precision must be a torch.distributed.fsdp.MixedPrecision, got "
                        f"{value!r}")
    if value.keep_low_precision_grads and value.param_dtype not in (None, torch.float32):
        raise NotImplementedError(
            "MixedPrecision(keep_low_precision_grads=True): fsdp_ext always hands the optimizer "
            "gradients in the parameters' dtype; leave it False (torch's default)")
    cast = value.cast_forward_inputs or (is_root and value.cast_root_forward_inputs)
    return MixedPrecisionPolicy(value.param_dtype, value.reduce_dtype, None, cast)
