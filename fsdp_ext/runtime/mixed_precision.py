"""The mixed-precision policy (FSDP2's `MixedPrecisionPolicy`), input/output casts and the gradient
divide factors."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2-style policy.

    Args:
        param_dtype: dtype of the unsharded parameters used in forward/backward (None: keep).
        reduce_dtype: dtype of the gradient reduce-scatter (None: the gradient's dtype).
        output_dtype: cast floating-point outputs of the module to this dtype (None: keep).
        cast_forward_inputs: cast floating-point forward inputs to `param_dtype`.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def cast_floating(tree, dtype: torch.dtype | None):
    """Cast every floating-point tensor in a pytree (args, kwargs, outputs) to `dtype`."""
    if dtype is None:
        return tree

    def cast(x):
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def divide_factors(data_parallel_size: int) -> tuple[float, float]:
    """Split 1/N into a pre-divide (before the sum) and a post-divide (after it).

    Dividing by about sqrt(N) on both sides keeps low-precision sums from overflowing (before) and
    from losing small values (after). Both factors are fused into the pack and epilogue kernels, so
    they cost no extra pass; gloo has no PREMUL_SUM, and AVG would not fuse the casts.
    """
    pre = 1
    while data_parallel_size % (pre * 2) == 0 and data_parallel_size / (pre * 2) >= pre * 2:
        pre *= 2
    return float(pre), float(data_parallel_size) / pre
