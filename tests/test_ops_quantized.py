"""The block-quantized collectives' ops (CommPolicy): each backend against the plain-torch
reference, bit for bit, for every value dtype and both formats, tails (n not a multiple of the
block), empty slots, NaN/Inf, and the argument checks; and the error bound the format promises."""
from __future__ import annotations

import pytest
import torch

from fsdp_ext import ops
from fsdp_ext.ops import reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FORMATS = ("int8", "fp8")
BACKENDS = ["cpp"] + (["cuda"] if torch.cuda.is_available() else [])


def _device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)]
    if n > 40:  # a block of zeros, and an exact tie for int8's rounding
        x[8:40] = 0.0
    return x.to(dtype)


def _quantized(values: torch.Tensor, world: int, block: int, fmt: str, backend: str):
    n = values.numel() // world
    wire = torch.full((world * ops.slot_bytes(n, block),), 0xAB, dtype=torch.uint8,
                      device=values.device)
    for r in range(world):
        ops.quantize_into_slot(values[r * n:(r + 1) * n], wire, r, block, fmt, backend=backend)
    return wire


def _slot_bytes_used(wire: torch.Tensor, world: int, n: int, block: int) -> torch.Tensor:
    """The bytes a slot defines (codes and scales, not the alignment padding)."""
    nb = (n + block - 1) // block
    stride = ops.slot_bytes(n, block)
    start = (n + 15) // 16 * 16
    keep = [wire[r * stride:r * stride + n] for r in range(world)]
    keep += [wire[r * stride + start:r * stride + start + 4 * nb] for r in range(world)]
    return torch.cat(keep).cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world,n,block", [(1, 1, 8), (2, 1000, 64), (3, 4096, 256),
                                           (4, 257, 32), (2, 0, 64)])
def test_matches_the_reference_bit_for_bit(backend, fmt, dtype, world, n, block):
    device = _device(backend)
    values = _values(world * n, dtype, seed=world * 1000 + n).to(device)
    ours = _quantized(values, world, block, fmt, backend)
    ref = _quantized(values.cpu(), world, block, fmt, "torch")
    assert torch.equal(_slot_bytes_used(ours, world, n, block),
                       _slot_bytes_used(ref, world, n, block))
    for out_dtype in DTYPES:
        out = torch.empty(world * n, dtype=out_dtype, device=device)
        expected = torch.empty(world * n, dtype=out_dtype)
        ops.dequantize_slots(ours, out, world, block, fmt, backend=backend)
        ops.dequantize_slots(ref, expected, world, block, fmt, backend="torch")
        assert torch.equal(out.cpu(), expected)
        total = torch.empty(n, dtype=out_dtype, device=device)
        expected_total = torch.empty(n, dtype=out_dtype)
        ops.dequantize_sum(ours, total, world, block, fmt, backend=backend)
        ops.dequantize_sum(ref, expected_total, world, block, fmt, backend="torch")
        assert torch.equal(total.cpu(), expected_total)


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_error_is_bounded_by_the_block_scale(backend, fmt):
    """int8: at most half a step (amax / 254) per value; fp8 e4m3: at most 2^-4 of the value
    relative (3 mantissa bits), or half the smallest step near zero."""
    device = _device(backend) if backend != "torch" else "cpu"
    block, n = 128, 128 * 20
    values = _values(n, torch.float32, seed=3).to(device)
    wire = _quantized(values, 1, block, fmt, backend)
    out = torch.empty(n, device=device)
    ops.dequantize_slots(wire, out, 1, block, fmt, backend=backend)
    amax = values.view(-1, block).abs().amax(1, keepdim=True)
    err = (out - values).view(-1, block).abs()
    if fmt == "int8":
        assert (err <= amax / 254 * (1 + 1e-5) + 1e-30).all()
    else:
        bound = values.view(-1, block).abs() * 2.0 ** -4 + amax / 448 * 2.0 ** -9
        assert (err <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_values_poison_their_block_only(backend, fmt):
    device = _device(backend) if backend != "torch" else "cpu"
    values = torch.ones(4 * 16, device=device)
    values[3], values[16 + 5] = float("nan"), float("inf")
    wire = _quantized(values, 1, 16, fmt, backend)
    out = torch.empty(64, device=device)
    ops.dequantize_slots(wire, out, 1, 16, fmt, backend=backend)
    assert out[:32].isnan().all() and (out[32:] == 1.0).all()


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
def test_bad_arguments_are_named(backend):
    device = _device(backend) if backend != "torch" else "cpu"
    src = torch.randn(100, device=device)
    wire = torch.empty(ops.slot_bytes(100, 32), dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="block"):
        ops.quantize_into_slot(src, wire, 0, 12, "int8", backend=backend)
    with pytest.raises(ValueError, match="wire"):
        ops.quantize_into_slot(src, wire, 1, 32, "int8", backend=backend)
    with pytest.raises(ValueError, match="fmt"):
        ops.quantize_into_slot(src, wire, 0, 32, "int4", backend=backend)
    with pytest.raises(ValueError, match="wire"):
        ops.dequantize_sum(wire, torch.empty(100, device=device), 2, 32, "int8", backend=backend)


def test_slot_layout():
    assert reference.slot_bytes(1000, 64) == 1008 + 16 * 4
    assert reference.slot_bytes(0, 64) == 0
    assert reference.slot_bytes(1, 8) == 32
