"""FSDP1's option types: `ShardingStrategy`, `BackwardPrefetch` and `MixedPrecision`."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..runtime.mixed_precision import MixedPrecisionPolicy


class ShardingStrategy(enum.Enum):
    FULL_SHARD = enum.auto()      # shard params, grads, optimizer state; free params after forward
    SHARD_GRAD_OP = enum.auto()   # same, but keep params unsharded between forward and backward
    NO_SHARD = enum.auto()        # replicate (DDP-like): all-reduce gradients
    HYBRID_SHARD = enum.auto()    # FULL_SHARD within a node, replicate across nodes
    _HYBRID_SHARD_ZERO2 = enum.auto()


class BackwardPrefetch(enum.Enum):
    BACKWARD_PRE = enum.auto()    # issue the previous unit's all-gather before this unit's backward
    BACKWARD_POST = enum.auto()   # ... after this unit's backward


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP1-style policy; converted to MixedPrecisionPolicy plus a buffer dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True

    def to_policy(self, is_root: bool) -> MixedPrecisionPolicy:
        cast = self.cast_forward_inputs or (is_root and self.cast_root_forward_inputs)
        return MixedPrecisionPolicy(self.param_dtype, self.reduce_dtype, None, cast)
