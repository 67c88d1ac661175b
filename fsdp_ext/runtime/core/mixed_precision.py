"""Mixed precision: torch's `MixedPrecisionPolicy` (param_dtype, reduce_dtype, output_dtype,
cast_forward_inputs; the unit reads it as it is), input/output casts and the gradient divide
factors."""
from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: F401  (the units' policy type)
from torch.utils._pytree import tree_map


def cast_floating(tree, dtype: torch.dtype | None):
    """Cast every floating-point tensor in a pytree (args, kwargs, outputs) to `dtype`."""
    if dtype is None:
        return tree

    def cast(x):
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def divide_factors(data_parallel_size: int, factor: float | None = None) -> tuple[float, float]:
    """Split the gradient divisor (1/N, or 1/factor when set_gradient_divide_factor gave one) into
    a pre-divide (before the sum) and a post-divide (after it).

    Dividing by about sqrt(N) on both sides keeps low-precision sums from overflowing (before) and
    from losing small values (after). Both factors are fused into the pack and epilogue kernels, so
    they cost no extra pass; gloo has no PREMUL_SUM, and AVG would not fuse the casts. A factor
    that is not a whole number is applied after the sum. The pre-divide is a power of two, so the
    pack's multiply by its reciprocal is exact; the post-divide is a division (the epilogue's), in
    the reduce dtype, which gives torch's FSDP2 (gloo's AVG) bits for fp32 and bf16 reductions at
    any world size.
    """
    divisor = data_parallel_size if factor is None else factor
    if float(divisor) != int(divisor) or divisor < 1:
        return 1.0, float(divisor)
    divisor = int(divisor)
    pre = 1
    while divisor % (pre * 2) == 0 and divisor / (pre * 2) >= pre * 2:
        pre *= 2
    return float(pre), float(divisor) / pre
