"""The CUDA kernels' own bodies (csrc/kernel_bodies.h), run on the host over their whole grid by
fsdp_ext._C.cuda_bodies_*, against the plain-torch reference and bit for bit against the C++ CPU
kernels (the same per-element conversions, other loops). Where an element is only converted
(casts, unscaled packs, unpack) NaN payloads and signs must match too: the conversions are integer
bit operations. After arithmetic (a scale, the accumulation) they need not: IEEE leaves the payload
of a NaN result unspecified (GPUs return their canonical NaN, x86 the first operand's), so there
NaN positions are compared and every other value bit for bit.

This is the code the GPU executes, packet alignment, tails and the jagged-grid run lookup included:
every dtype pair; NaN, +-inf, subnormals, -0 and rounding ties; windows that cut tensors; runs longer
than one block (4096 elements); addresses that are not 16-byte aligned; empty tensors.
"""
import itertools

import pytest
import torch

import fsdp_ext.ops as ops

from .test_ops_cpp import (BITS, DIVISORS, PAIRS, SCALES, assert_bitwise_equal, random_layout,
                           stress_values)
from .test_ops_quantized import irregular_quant_input

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="fsdp_ext._C is not built")
if ops.HAVE_EXTENSION:
    from fsdp_ext import _C

# Element counts: empty, one, a packet's tail, one block exactly, several blocks with a tail.
SIZES = [0, 1, 7, 9, 4096, 2 * 4096 + 5, 300]


def assert_identical(actual, expected, arithmetic: bool = False):
    """Every bit equal, NaN signs and payloads included (after `arithmetic`: NaN positions)."""
    differ = actual.view(BITS[actual.dtype]) != expected.view(BITS[expected.dtype])
    if arithmetic:
        differ &= ~(actual.isnan() & expected.isnan())
    assert not bool(differ.any()), f"{int(differ.sum())} elements differ in their bits"


def misaligned(values: torch.Tensor, shift: int) -> torch.Tensor:
    """`values` copied into a buffer at element offset `shift`: its address is then not 16-byte
    aligned for shift % (16 / itemsize) != 0, which sends the kernels down their scalar paths."""
    buffer = torch.empty(values.numel() + shift, dtype=values.dtype)
    view = buffer[shift:]
    view.copy_(values.reshape(-1))
    return view.view(values.shape)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("shift", [0, 1, 3])
def test_pack(src_dtype, dst_dtype, scale, shift):
    numels = SIZES
    offsets, total = random_layout(numels, seed=shift)
    srcs = [misaligned(stress_values(n, src_dtype, seed=i), (shift + i) % 8)
            for i, n in enumerate(numels)]
    for lo, hi in [(0, total), (3, total - 4097), (5000, 5001), (0, 0)]:
        got = misaligned(torch.full((hi - lo,), 7.0, dtype=dst_dtype), shift)
        want, cpp = got.clone(), got.clone()
        _C.cuda_bodies_pack(srcs, offsets, got, lo, scale)
        ops.pack(srcs, offsets, want, lo, scale, backend="torch")
        ops.pack(srcs, offsets, cpp, lo, scale, backend="cpp")
        assert_bitwise_equal(got, want)
        assert_identical(got, cpp, arithmetic=scale != 1.0)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS)
@pytest.mark.parametrize("shift", [0, 1, 3])
def test_unpack(src_dtype, dst_dtype, shift):
    numels = SIZES
    offsets, total = random_layout(numels, seed=10 + shift)
    for lo, hi in [(0, total), (2, total - 4100), (4100, 4100 + 4097)]:
        src = misaligned(stress_values(hi - lo, src_dtype, seed=lo), shift)
        got = [misaligned(torch.full((n,), -5.0, dtype=dst_dtype), (shift + i) % 8)
               for i, n in enumerate(numels)]
        want, cpp = [t.clone() for t in got], [t.clone() for t in got]
        _C.cuda_bodies_unpack(src, lo, offsets, got)
        ops.unpack(src, lo, offsets, want, backend="torch")
        ops.unpack(src, lo, offsets, cpp, backend="cpp")
        for g, w, c in zip(got, want, cpp):
            assert_bitwise_equal(g, w)
            assert_identical(g, c)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS)
@pytest.mark.parametrize("shift", [0, 1, 3])
def test_cast_into_slot(src_dtype, dst_dtype, shift):
    for n, slot in itertools.product(SIZES, (0, 2)):
        shard = misaligned(stress_values(n, src_dtype, seed=n), shift)
        got = misaligned(torch.full((3 * n,), 9.0, dtype=dst_dtype), (shift * 3) % 8)
        want, cpp = got.clone(), got.clone()
        _C.cuda_bodies_cast_into_slot(shard, got, slot)
        ops.cast_into_slot(shard, want, slot, backend="torch")
        ops.cast_into_slot(shard, cpp, slot, backend="cpp")
        assert_bitwise_equal(got, want)
        assert_identical(got, cpp)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS)
@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_grad_epilogue(src_dtype, dst_dtype, divisor, accumulate):
    for i, n in enumerate(SIZES):
        reduced = misaligned(stress_values(n, src_dtype, seed=i), i % 4)
        got = misaligned(stress_values(n, dst_dtype, seed=100 + i), (i + 1) % 4)
        want, cpp = got.clone(), got.clone()
        _C.cuda_bodies_grad_epilogue(reduced, got, divisor, accumulate)
        ops.grad_epilogue(reduced, want, divisor, accumulate, backend="torch")
        ops.grad_epilogue(reduced, cpp, divisor, accumulate, backend="cpp")
        assert_bitwise_equal(got, want)
        assert_identical(got, cpp, arithmetic=accumulate or divisor != 1.0)


def test_bad_arguments_are_refused_as_on_the_gpu():
    """The host runner goes through the CUDA host side's argument checks."""
    with pytest.raises(ValueError, match="gathered: 6 elements cannot hold slot 1 of 4"):
        _C.cuda_bodies_cast_into_slot(torch.ones(4), torch.empty(6), 1)
    with pytest.raises(ValueError, match="reduced has 3 elements but out has 4"):
        _C.cuda_bodies_grad_epilogue(torch.ones(3), torch.empty(4), 1.0, False)
    with pytest.raises(ValueError, match="srcs\\[0\\]: dtype Int is not one of fp32/bf16/fp16"):
        _C.cuda_bodies_pack([torch.ones(4, dtype=torch.int32)], [0], torch.empty(4), 0, 1.0)


# ---- quantized collectives: quantize.cu's warp-per-block bodies (csrc/quant_warp_bodies.h) ----

QUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def misaligned_bytes(numel: int, shift: int) -> torch.Tensor:
    """A uint8 tensor of numel bytes (0xAB) starting `shift` bytes past an aligned address."""
    return torch.full((numel + shift,), 0xAB, dtype=torch.uint8)[shift:]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=str)
@pytest.mark.parametrize("shift,slot_shift", [(0, 0), (1, 0), (0, 3), (3, 6)])
def test_quantize_into_warp_bodies(fmt, dtype, shift, slot_shift):
    """Codes and scales bit for bit the reference's (NaN scales included: one constant), with
    values and codes lined up for packets (0, 0), never lined up, and lined up at another
    offset (values 3 elements, codes 6 bytes past a boundary: fp32 blocks meet at
    different heads)."""
    values, starts = irregular_quant_input(dtype, seed=1)
    values = misaligned(values, shift)
    n, nblocks = values.numel(), starts.numel()
    got = misaligned_bytes(ops.slot_bytes(n, nblocks), slot_shift)
    want = got.clone()
    _C.cuda_bodies_quantize_into(values, got, starts, fmt == "fp8")
    ops.quantize_into(values, want, starts, fmt, backend="torch")
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=str)
@pytest.mark.parametrize("world,pad", [(1, 0), (3, 0), (3, 4), (2, 16)])
def test_dequantize_warp_bodies(fmt, dtype, world, pad):
    """dequantize_from (world 1) and dequantize_sum of `world` slots into every dtype, with
    strides that are packet multiples and one that is not for 16-bit values (pad 4: their
    scalar path; fp32 takes 4-byte packets of codes and still uses them), out
    aligned and not: bit for bit the reference's, NaN where NaN."""
    values, starts = irregular_quant_input(torch.float32, seed=2)
    n, nblocks = values.numel(), starts.numel()
    stride = ops.slot_bytes(n, nblocks) + pad
    wire = torch.zeros(world * stride, dtype=torch.uint8)
    for r in range(world):
        scaled = values * (r + 1) if r % 2 == 0 else values.flip(0)
        ops.quantize_into(scaled, wire.narrow(0, r * stride, stride), starts, fmt,
                          backend="torch")
    for out_shift in (0, 1):
        got = misaligned(torch.full((n,), 7.0, dtype=dtype), out_shift)
        want = got.clone()
        if world == 1:
            _C.cuda_bodies_dequantize_from(wire, got, starts, fmt == "fp8")
            ops.dequantize_from(wire, want, starts, fmt, backend="torch")
        else:
            _C.cuda_bodies_dequantize_sum(wire, got, starts, world, stride, fmt == "fp8")
            ops.dequantize_sum(wire, want, starts, world, stride, fmt, backend="torch")
        assert_identical(got, want, arithmetic=True)
