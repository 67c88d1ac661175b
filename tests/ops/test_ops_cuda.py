"""The CUDA kernels (backend="cuda") against the plain-torch reference on CUDA tensors, bit for bit.

The same cases as tests/ops/test_ops_cpp.py (whose helpers these reuse); skipped without a GPU.
"""
import pytest
import torch

import fsdp_ext.ops as ops

from .test_ops_cpp import (DIVISORS, DTYPES, PAIRS, SCALES, SHAPES, WINDOWS, _name,
                           check_cast_into_slot, check_grad_epilogue, check_pack, check_unpack,
                           opcheck_samples)

pytestmark = pytest.mark.skipif(not (ops.HAVE_EXTENSION and torch.cuda.is_available()),
                                reason="needs a GPU and fsdp_ext._C built with CUDA")
CUDA = dict(device="cuda", backend="cuda")


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: _name(d))
@pytest.mark.parametrize("scale", SCALES)
def test_pack_dtype_pairs(src_dtype, dst_dtype, scale):
    for seed, window in enumerate(WINDOWS):
        check_pack(SHAPES, [src_dtype], dst_dtype, scale, window, seed=seed, **CUDA)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: _name(d))
def test_unpack_dtype_pairs(src_dtype, dst_dtype):
    for seed, window in enumerate(WINDOWS):
        check_unpack(SHAPES, src_dtype, [dst_dtype], window, seed=seed, **CUDA)


def test_mixed_dtypes_empty_and_many_tensors():
    check_pack(SHAPES, DTYPES, torch.bfloat16, 0.5, (3, 170), **CUDA)
    check_unpack(SHAPES, torch.float32, DTYPES, (3, 170), **CUDA)
    check_pack([], [torch.float32], torch.float32, 1.0, (0, 11), **CUDA)
    check_unpack([], torch.float32, [torch.float32], (0, 11), **CUDA)
    gen = torch.Generator().manual_seed(3)
    shapes = [(int(s),) for s in torch.randint(0, 20, (1000,), generator=gen) * 2 + 1]
    check_pack(shapes, DTYPES, torch.float32, 1.0, None, seed=5, **CUDA)
    check_unpack(shapes, torch.bfloat16, DTYPES, (77, 12001), seed=7, **CUDA)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: _name(d))
def test_large_and_misaligned(src_dtype, dst_dtype):
    # Odd offsets and window edges make source and destination reach 16-byte boundaries at
    # different elements: the kernel must fall back from packets to scalars, or align the head.
    for window in [None, (1, (3 << 19) - 3), (4, 1 << 20)]:
        check_pack([(1 << 20,), (1 << 19,)], [src_dtype], dst_dtype, 1.0, window, **CUDA)
        check_unpack([(1 << 20,), (1 << 19,)], src_dtype, [dst_dtype], window, **CUDA)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: _name(d))
def test_cast_into_slot(src_dtype, dst_dtype):
    for shape, world in [((3, 7), 4), ((1,), 1), ((0,), 3), (((1 << 16) + 3,), 2)]:
        for slot in {0, world - 1}:
            check_cast_into_slot(shape, src_dtype, dst_dtype, world, slot, **CUDA)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: _name(d))
@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_grad_epilogue(src_dtype, dst_dtype, divisor, accumulate):
    for shape in [(4, 33), (1,), (0,), ((1 << 16) + 1,)]:
        check_grad_epilogue(shape, src_dtype, dst_dtype, divisor, accumulate, **CUDA)


def test_runs_on_the_current_stream():
    side = torch.cuda.Stream()
    src = torch.randn(1 << 20, device="cuda")
    out = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.pack([src], [0], out, backend="cuda")
        expected = src.to(torch.bfloat16)
    side.synchronize()
    assert torch.equal(out, expected)


def test_wrong_device_is_named():
    with pytest.raises(ValueError, match=r"srcs\[0\]"):
        ops.pack([torch.zeros(4)], [0], torch.zeros(8, device="cuda"), backend="cuda")
    with pytest.raises(ValueError, match="reduced"):
        ops.grad_epilogue(torch.zeros(4), torch.zeros(4, device="cuda"), backend="cuda")


@pytest.mark.parametrize("index", range(4), ids=["pack", "unpack", "cast_into_slot", "grad_epilogue"])
def test_opcheck(index):
    op, args = opcheck_samples("cuda")[index]
    torch.library.opcheck(op, args)
