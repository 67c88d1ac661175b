"""Triton kernels of the block-quantized collectives (semantics and layout: reference.py).

One program per block of `starts` (a block holds at most the policy's block_size values; a
program walks it in chunks of BLOCK lanes: amax first, then the codes). As in triton_kernels.py,
values travel as integer bits and every rounding is done on bits, so the interpreter and a GPU
give the reference's bits: fp32 -> float8_e4m3fn rounds to nearest even with integer operations
(the interpreter has no fp8 type), int8's rint is floor(q + 0.5) with ties sent to even (exact for
the |q| <= 127.5 it sees), and divisions are IEEE-rounded (`div_rn`). The sum over slots is
launched without fp fusion: each product is rounded before it is added, as in the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_bits import _e4m3_bits_from_f32
from .triton_kernels import _KIND_OF, _bits, _load_f32, _store_f32

BLOCK = 256  # lanes per chunk of a quantization block


@triton.jit
def _larger(a, b):
    """The combine of a max reduction (tl.reduce is a builtin; tl.max is a @jit helper of
    triton's standard library, which the interpreter cannot call when triton was imported before
    TRITON_INTERPRET was set: see triton_kernels.py)."""
    return tl.maximum(a, b)


@triton.jit
def _f32_from_code(code, FP8: tl.constexpr):
    """A code byte (uint8 lanes) -> its fp32 value: int8, or float8_e4m3fn."""
    if FP8:
        c = code.to(tl.uint32)
        exponent = (c >> 3) & 0xF
        mantissa = c & 7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        subnormal = mantissa.to(tl.float32) * 0.001953125  # 2**-9, exact
        value = tl.where(exponent == 0, subnormal, normal)
        value = tl.where((exponent == 15) & (mantissa == 7), float("nan"), value)
        return (value.to(tl.uint32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32,
                                                                            bitcast=True)
    else:
        return code.to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _quantize_kernel(
    src_ptr,        # [n] values, as int32/int16 bits
    slot_ptr,       # the slot's bytes (uint8): codes at 0, fp32 scales at scales_at
    starts_ptr,     # [nblocks] int64 block starts
    nblocks,        # blocks
    n,              # values
    scales_at,      # byte offset of the scales: align16(n)
    SRC_KIND: tl.constexpr,  # kind code of src
    FP8: tl.constexpr,       # float8_e4m3fn codes (else int8)
    BLOCK: tl.constexpr,     # lanes per chunk
):
    b = tl.program_id(0).to(tl.int64)
    first = tl.load(starts_ptr + b)
    end = tl.load(starts_ptr + b + 1, mask=b + 1 < nblocks, other=n)
    amax = tl.full([], 0.0, tl.float32)
    bad = tl.full([], 0, tl.int32)
    for off in range(first, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < end
        a = tl.where(mask, tl.abs(_load_f32(src_ptr + idx, mask, SRC_KIND)), 0.0)
        amax = tl.maximum(amax, tl.reduce(a, 0, _larger))
        bad = tl.maximum(bad, tl.reduce(((a > 3.4028234663852886e38) | (a != a)).to(tl.int32),
                                        0, _larger))
    qmax = 448.0 if FP8 else 127.0
    scale = tl.where(bad > 0, float("nan"), tl.math.div_rn(amax, qmax))
    scale_ptr = (slot_ptr + scales_at).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr + b, scale)
    usable = (bad == 0) & (scale > 0.0)
    divisor = tl.where(usable, scale, 1.0)
    for off in range(first, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < end
        q = tl.math.div_rn(_load_f32(src_ptr + idx, mask, SRC_KIND), divisor)
        if FP8:
            code = _e4m3_bits_from_f32(q)
        else:
            t = q + 0.5
            r = tl.floor(t)
            odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
            r = tl.where((t == r) & odd, r - 1.0, r)
            r = tl.minimum(tl.maximum(r, -127.0), 127.0)
            code = r.to(tl.int32).to(tl.uint32) & 0xFF
        code = tl.where(usable, code, 0)
        tl.store(slot_ptr + idx, code.to(tl.uint8), mask=mask)


@triton.jit
def _dequantize_kernel(
    wire_ptr,       # the slots' bytes (uint8), `stride` apart
    out_ptr,        # [n] values out, as int32/int16 bits
    starts_ptr,     # [nblocks] int64 block starts
    nblocks,        # blocks
    n,              # values per slot
    scales_at,      # byte offset of a slot's scales: align16(n)
    world,          # slots to add (SUM), else 1
    stride,         # bytes between slots
    OUT_KIND: tl.constexpr,  # kind code of out
    FP8: tl.constexpr,       # float8_e4m3fn codes (else int8)
    SUM: tl.constexpr,       # the sum over `world` slots, from 0.0 in slot order (else one slot)
    BLOCK: tl.constexpr,     # lanes per chunk
):
    b = tl.program_id(0).to(tl.int64)
    first = tl.load(starts_ptr + b)
    end = tl.load(starts_ptr + b + 1, mask=b + 1 < nblocks, other=n)
    for off in range(first, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < end
        if SUM:
            value = tl.full([BLOCK], 0.0, tl.float32)  # (tl.zeros is a @jit helper)
            for r in range(0, world):
                # 64-bit offset: world slots span more than 2**31 bytes for a large gather group,
                # and a 32-bit `r * stride` (stride fits in 32 bits, so triton passes it as i32)
                # would wrap to a negative offset.
                base = wire_ptr + tl.cast(r, tl.int64) * stride
                scale = tl.load((base + scales_at).to(tl.pointer_type(tl.float32)) + b)
                code = tl.load(base + idx, mask=mask, other=0)
                value = value + _f32_from_code(code, FP8) * scale
        else:
            scale = tl.load((wire_ptr + scales_at).to(tl.pointer_type(tl.float32)) + b)
            value = _f32_from_code(tl.load(wire_ptr + idx, mask=mask, other=0), FP8) * scale
        _store_f32(out_ptr + idx, value, mask, OUT_KIND)


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def quantize_into(src: torch.Tensor, slot: torch.Tensor, starts: torch.Tensor, fmt: str) -> None:
    """See reference.quantize_into (arguments checked by fsdp_ext.ops)."""
    n, nblocks = src.numel(), starts.numel()
    if n == 0:
        return
    _quantize_kernel[(nblocks,)](_bits(src), slot, starts, nblocks, n, _align16(n),
                                 SRC_KIND=_KIND_OF[src.dtype], FP8=fmt == "fp8", BLOCK=BLOCK)


def _dequantize(wire, out, starts, world, stride, fmt, summed: bool) -> None:
    n, nblocks = out.numel(), starts.numel()
    if n == 0:
        return
    _dequantize_kernel[(nblocks,)](wire, _bits(out), starts, nblocks, n, _align16(n), world,
                                   stride, OUT_KIND=_KIND_OF[out.dtype], FP8=fmt == "fp8",
                                   SUM=summed, BLOCK=BLOCK, enable_fp_fusion=False)


def dequantize_from(slot: torch.Tensor, out: torch.Tensor, starts: torch.Tensor, fmt: str) -> None:
    """See reference.dequantize_from."""
    _dequantize(slot, out, starts, 1, 0, fmt, summed=False)


def dequantize_sum(wire: torch.Tensor, out: torch.Tensor, starts: torch.Tensor, world: int,
                   stride: int, fmt: str) -> None:
    """See reference.dequantize_sum."""
    _dequantize(wire, out, starts, world, stride, fmt, summed=True)
