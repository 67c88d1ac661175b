"""fp32 -> narrower float formats on integer bits, for the Triton kernels (triton_kernels.py:
bf16 and fp16; triton_quant.py: float8_e4m3fn).

Round to nearest even with integer operations, so a GPU and the CPU interpreter
(TRITON_INTERPRET=1), whose own fp32 -> bf16 cast truncates and which has no fp8 type, give the
same bits, those of torch's casts (csrc/flat_layout.h and csrc/quant_bodies.h do the same in C++).
fp16 and e4m3 share one routine (`_rounded_magnitude`): the same steps with the format's
constants. Only builtins of triton.language are used (see triton_kernels.py).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rounded_magnitude(mag, DROP: tl.constexpr, REBIAS: tl.constexpr, SUB_BASE: tl.constexpr,
                       SUB_MAX: tl.constexpr, NORMAL_AT: tl.constexpr):
    """|x|'s bits (mag, uint32, not NaN) rounded to nearest even into a narrow float with
    DROP fewer mantissa bits, before saturation: normal results (mag >= NORMAL_AT, the format's
    smallest normal) drop DROP mantissa bits and rebias the exponent (subtract REBIAS, the bias
    difference shifted to the exponent's place; a mantissa carry bumps the exponent, as it
    must); smaller ones are the 24-bit significand >> (SUB_BASE - exponent) in units of the
    format's smallest subnormal, the shift clamped to [DROP + 1, SUB_MAX] so lanes that take the
    other branch stay well defined (shifts past 24 all round to zero)."""
    normal = ((mag + (((1 << (DROP - 1)) - 1) + ((mag >> DROP) & 1))) >> DROP) - REBIAS
    mantissa = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(SUB_BASE - (mag >> 23).to(tl.int32), DROP + 1),
                       SUB_MAX).to(tl.uint32)
    quotient = mantissa >> shift
    remainder = mantissa & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((quotient & 1) == 1))
    subnormal = quotient + round_up.to(tl.uint32)
    return tl.where(mag >= NORMAL_AT, normal, subnormal)


@triton.jit
def _bf16_bits_from_f32(x):
    """Round fp32 to bf16 (nearest even) on bits; NaN stays a (quiet) NaN, inf stays inf."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, (bits >> 16) | 0x40, rounded).to(tl.uint16)


@triton.jit
def _f16_bits_from_f32(x):
    """Round fp32 to fp16 (nearest even) on bits: overflow -> inf, exact subnormals, NaN -> NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 16) & 0x8000
    mag = bits & 0x7FFFFFFF
    # 13 mantissa bits dropped, exponent 127 -> 15; subnormals in units of 2**-24.
    result = _rounded_magnitude(mag, 13, 112 << 10, 126, 25, 0x38800000)
    result = tl.where(mag >= 0x477FF000, 0x7C00, result)  # >= 65520 rounds to inf
    # NaN: quiet, top payload bits kept; masked to 10 bits so no exponent bit reaches the sign.
    result = tl.where(mag > 0x7F800000, 0x7E00 | ((mag >> 13) & 0x3FF), result)
    return (result | sign).to(tl.uint16)


@triton.jit
def _e4m3_bits_from_f32(x):
    """fp32 -> float8_e4m3fn bits (uint32 lanes), round to nearest even, as torch's cast: |x| >=
    448 (infinities too) saturates to +-448 (0x7E), NaN -> 0x7F. The quantizer meets |x| > 448
    when a block's scale is subnormal (amax / 448 keeps few bits: amax / scale reaches 672)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # 20 mantissa bits dropped, exponent 127 -> 7; subnormals in units of 2**-9.
    result = _rounded_magnitude(mag, 20, 120 << 3, 141, 31, 0x3C800000)
    result = tl.where(mag >= 0x43E00000, 0x7E, result)  # 448 and beyond (`normal` overflows)
    result = tl.where(mag > 0x7F800000, 0x7F, result)
    return result | sign
