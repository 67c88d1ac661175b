"""The block-quantized collectives' ops (CommPolicy): each backend against the plain-torch
reference, bit for bit, for every value dtype and both formats, irregular blocks (a block at
every parameter boundary, as the runtime cuts them), tails, empty inputs, NaN/Inf, and the
argument checks; and the error bound each format promises."""
from __future__ import annotations

import pytest
import torch

from fsdp_ext import ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FORMATS = ("int8", "fp8")
CUDA = torch.cuda.is_available()
# Without a GPU the cuda cases are collected and skipped, so the summary counts them.
BACKENDS = ["cpp", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU (make gpu-check)"))]
RUNNABLE = ["cpp"] + (["cuda"] if CUDA else [])   # for loops inside one test


def _device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, max(n, 1))[:n][
        torch.randperm(n, generator=g)]
    if n > 40:
        x[8:40] = 0.0  # an all-zero block
    return x.to(dtype)


def _starts(n: int, block: int, seed: int) -> torch.Tensor:
    """Blocks of at most `block` values restarting at a few random 'parameter' boundaries."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted({0, *torch.randint(0, max(n, 1), (3,), generator=g).tolist()})
    cuts = [c for c in cuts if c < n] or [0]
    starts = []
    for begin, end in zip(cuts, cuts[1:] + [n]):
        starts.extend(range(begin, end, block))
    return torch.tensor(starts or [0], dtype=torch.int64)


def _quantized(values, starts_per_slot, world, fmt, backend):
    n = values.numel() // world
    stride = max(ops.slot_bytes(n, s.numel()) for s in starts_per_slot)
    wire = torch.full((world * stride,), 0xAB, dtype=torch.uint8, device=values.device)
    for r in range(world):
        ops.quantize_into(values[r * n:(r + 1) * n], wire.narrow(0, r * stride, stride),
                          starts_per_slot[r].to(values.device), fmt, backend=backend)
    return wire, stride


def _defined_bytes(wire, stride, world, n, nblocks):
    """The bytes a slot defines (codes and scales, not its alignment padding)."""
    start = (n + 15) // 16 * 16
    parts = [wire[r * stride:r * stride + n] for r in range(world)]
    parts += [wire[r * stride + start:r * stride + start + 4 * nblocks[r]] for r in range(world)]
    return torch.cat(parts).cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world,n,block", [(1, 1, 8), (2, 1000, 64), (3, 4096, 256),
                                           (4, 257, 32), (2, 0, 64)])
def test_matches_the_reference_bit_for_bit(backend, fmt, dtype, world, n, block):
    device = _device(backend)
    values = _values(world * n, dtype, seed=world * 1000 + n).to(device)
    starts = [_starts(n, block, seed=r) for r in range(world)]
    ours, stride = _quantized(values, starts, world, fmt, backend)
    ref, _ = _quantized(values.cpu(), starts, world, fmt, "torch")
    nblocks = [s.numel() for s in starts]
    assert torch.equal(_defined_bytes(ours, stride, world, n, nblocks),
                       _defined_bytes(ref, stride, world, n, nblocks))
    for out_dtype in DTYPES:
        for r in range(world):
            out = torch.empty(n, dtype=out_dtype, device=device)
            expected = torch.empty(n, dtype=out_dtype)
            ops.dequantize_from(ours.narrow(0, r * stride, stride), out, starts[r].to(device),
                                fmt, backend=backend)
            ops.dequantize_from(ref.narrow(0, r * stride, stride), expected, starts[r], fmt,
                                backend="torch")
            assert torch.equal(out.cpu(), expected)
        same, _ = _quantized(values, [starts[0]] * world, world, fmt, backend)
        same_ref, _ = _quantized(values.cpu(), [starts[0]] * world, world, fmt, "torch")
        total = torch.empty(n, dtype=out_dtype, device=device)
        expected_total = torch.empty(n, dtype=out_dtype)
        ops.dequantize_sum(same, total, starts[0].to(device), world, stride, fmt,
                           backend=backend)
        ops.dequantize_sum(same_ref, expected_total, starts[0], world, stride, fmt,
                           backend="torch")
        assert torch.equal(total.cpu(), expected_total)


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_error_is_bounded_by_each_block_scale(backend, fmt):
    """int8: at most half a step (block amax / 254) per value; fp8 e4m3: 2^-4 of the value
    relative (3 mantissa bits), or half the smallest subnormal step of the block near zero."""
    device = _device(backend) if backend != "torch" else "cpu"
    block, n = 128, 128 * 20
    values = _values(n, torch.float32, seed=3).to(device)
    starts = torch.arange(0, n, block, device=device)
    wire, _ = _quantized(values, [starts], 1, fmt, backend)
    out = torch.empty(n, device=device)
    ops.dequantize_from(wire, out, starts, fmt, backend=backend)
    amax = values.view(-1, block).abs().amax(1, keepdim=True)
    err = (out - values).view(-1, block).abs()
    if fmt == "int8":
        assert (err <= amax / 254 * (1 + 1e-5)).all()
    else:
        bound = values.view(-1, block).abs() * 2.0 ** -4 + amax / 448 * 2.0 ** -9
        assert (err <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_values_poison_their_block_only(backend, fmt):
    device = _device(backend) if backend != "torch" else "cpu"
    values = torch.ones(64, device=device)
    values[3], values[16 + 5] = float("nan"), float("inf")
    starts = torch.arange(0, 64, 16, device=device)
    wire, _ = _quantized(values, [starts], 1, fmt, backend)
    out = torch.empty(64, device=device)
    ops.dequantize_from(wire, out, starts, fmt, backend=backend)
    assert out[:32].isnan().all() and (out[32:] == 1.0).all()


def _float_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns in [0, 2^32) -> float32 values."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(
        torch.float32)


def every_exponent_blocks(per_exponent: int, block: int, seed: int) -> torch.Tensor:
    """[blocks, block] values: per biased exponent E (0, the subnormals, to 254) `per_exponent`
    blocks whose first value has exponent E (the block's amax, nearly always) and the others
    exponents down to E - 30, every mantissa and sign drawn at random; then one block per amax
    k * 2^-149, k < 4096, where the scale amax / QMAX is subnormal with few significant bits (and
    amax / scale exceeds QMAX: up to 1.5 QMAX)."""
    g = torch.Generator().manual_seed(seed)
    top = torch.arange(255).repeat_interleave(per_exponent)
    exponent = (top[:, None] - torch.randint(0, 31, (top.numel(), block), generator=g)).clamp(0)
    exponent[:, 0] = top
    mantissa = torch.randint(0, 1 << 23, exponent.shape, generator=g)
    sign = torch.randint(0, 2, exponent.shape, generator=g)
    spread = _float_bits((sign << 31) | (exponent << 23) | mantissa)
    k = torch.arange(4096)
    below = (torch.rand(4096, block, generator=g) * k[:, None]).long()  # subnormal multiples
    below[:, 0] = k
    tiny = _float_bits(below) * torch.where(torch.rand(4096, block, generator=g) < 0.5, -1.0, 1.0)
    return torch.cat([spread, tiny])


def irregular_quant_input(dtype: torch.dtype, seed: int):
    """(values, starts): blocks of every length 0-300 and random ones (shorter than a warp's
    packet step, longer than several), over every exponent of `dtype` and subnormal scales, with
    NaN, +-inf, -0 and all-zero blocks planted."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.cat([torch.arange(301), torch.randint(0, 1100, (60,), generator=g)])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(starts[-1])
    pool = every_exponent_blocks(per_exponent=2, block=64, seed=seed).reshape(-1)
    values = pool[torch.randint(0, pool.numel(), (n,), generator=g)]
    if dtype == torch.float16:  # within fp16's range, down to its subnormals
        values = torch.randn(n, generator=g) * 2.0 ** torch.randint(-26, 15, (n,), generator=g)
    values = values.to(dtype)
    starts = starts[:-1]
    for at, planted in ((starts[200], float("nan")), (starts[220] + 31, float("inf")),
                        (starts[240] + 7, -float("inf")), (starts[300] + 200, float("nan"))):
        values[int(at)] = planted
    values[int(starts[250]):int(starts[252])] = 0.0
    values[int(starts[260]):int(starts[261])] = -0.0
    return values, starts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_exponent_and_subnormal_scales_match_the_reference(backend, fmt):
    """Codes, scales and dequantized values bit for bit over the whole float32 range: random
    mantissas at every exponent, and every subnormal amax below 4096 * 2^-149 (a block of amax
    465 * 2^-149 dequantized to NaN, 1000 * 2^-149 to -0, where fp8's code overflowed)."""
    device = _device(backend)
    values = every_exponent_blocks(per_exponent=4, block=16, seed=7)
    n = values.numel()
    starts = torch.arange(0, n, 16)
    wires = {}
    for name, dev in ((backend, device), ("torch", "cpu")):
        wire = torch.zeros(ops.slot_bytes(n, starts.numel()), dtype=torch.uint8, device=dev)
        ops.quantize_into(values.reshape(-1).to(dev), wire, starts.to(dev), fmt, backend=name)
        wires[name] = wire.cpu()
    assert torch.equal(wires[backend], wires["torch"])
    out, expected = torch.empty(n, device=device), torch.empty(n)
    ops.dequantize_from(wires["torch"].to(device), out, starts.to(device), fmt, backend=backend)
    ops.dequantize_from(wires["torch"], expected, starts, fmt, backend="torch")
    assert torch.equal(out.cpu().view(torch.int32), expected.view(torch.int32))
    assert not expected.isnan().any()


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("fmt", FORMATS)
def test_all_float32_bit_patterns_match_the_reference(fmt):
    """Every one of the 2^32 float32 bit patterns quantized (blocks of 64 consecutive patterns,
    in chunks) and dequantized by the C++ kernels, against the reference, bit for bit (NaN
    blocks: NaN where the reference has NaN)."""
    chunk, block = 1 << 24, 64
    starts = torch.arange(0, chunk, block)
    slot = ops.slot_bytes(chunk, starts.numel())
    for first in range(0, 1 << 32, chunk):
        values = _float_bits(torch.arange(first, first + chunk))
        wire, ref = (torch.empty(slot, dtype=torch.uint8) for _ in range(2))
        ops.quantize_into(values, wire, starts, fmt, backend="cpp")
        ops.quantize_into(values, ref, starts, fmt, backend="torch")
        assert torch.equal(wire[:chunk], ref[:chunk]), hex(first)
        scales = wire[(chunk + 15) // 16 * 16:][:4 * starts.numel()].view(torch.int32)
        ref_scales = ref[(chunk + 15) // 16 * 16:][:4 * starts.numel()].view(torch.float32)
        nan = ref_scales.isnan()
        assert torch.equal(scales[~nan], ref_scales.view(torch.int32)[~nan]), hex(first)
        assert scales.view(torch.float32)[nan].isnan().all(), hex(first)
        out, expected = torch.empty(chunk), torch.empty(chunk)
        ops.dequantize_from(ref, out, starts, fmt, backend="cpp")
        ops.dequantize_from(ref, expected, starts, fmt, backend="torch")
        same = out.view(torch.int32) == expected.view(torch.int32)
        assert (same | (out.isnan() & expected.isnan())).all(), hex(first)


def test_float32_max_dequantizes_to_infinity_in_int8_only():
    """The spec's top end (reference.py): a block whose amax is FLT_MAX dequantizes it to +-inf
    in int8 (127 * RN(FLT_MAX / 127) rounds past FLT_MAX) and to +-FLT_MAX in fp8, in every
    backend alike."""
    big = torch.finfo(torch.float32).max
    values = torch.tensor([big, -big, 1.0, 0.0])
    starts = torch.zeros(1, dtype=torch.int64)
    for fmt, top in (("int8", float("inf")), ("fp8", big)):
        for backend in RUNNABLE + ["torch"]:
            device = _device(backend)
            wire = torch.zeros(ops.slot_bytes(4, 1), dtype=torch.uint8, device=device)
            ops.quantize_into(values.to(device), wire, starts.to(device), fmt, backend=backend)
            out = torch.empty(4, device=device)
            ops.dequantize_from(wire, out, starts.to(device), fmt, backend=backend)
            assert out[:2].cpu().tolist() == [top, -top], (fmt, backend)


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
def test_bad_arguments_are_named(backend):
    device = _device(backend) if backend != "torch" else "cpu"
    src = torch.randn(100, device=device)
    starts = torch.arange(0, 100, 32, device=device)
    slot = torch.empty(ops.slot_bytes(100, 4), dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="slot|wire|bytes"):
        ops.quantize_into(src, slot[:50], starts, "int8", backend=backend)
    with pytest.raises(ValueError, match="starts"):
        ops.quantize_into(src, slot, starts.int(), "int8", backend=backend)
    with pytest.raises(ValueError, match="fmt"):
        ops.quantize_into(src, slot, starts, "int4", backend=backend)
    with pytest.raises(ValueError, match="stride"):
        ops.dequantize_sum(slot, torch.empty(100, device=device), starts, 2, 10, "int8",
                           backend=backend)


def test_slot_layout_and_runtime_blocks():
    from fsdp_ext.runtime.bucket.layout import rows_layout
    from fsdp_ext.runtime.wire.quantized import block_starts
    assert ops.slot_bytes(1000, 16) == 1008 + 16 * 4
    assert ops.slot_bytes(0, 0) == 0
    # two small parameters and a large one in one copied group: a block at each parameter, and
    # one at each parameter's end, where its padding starts (a rank holds 6, 150 and 5 values,
    # each padded to a multiple of 8), so that no scale covers padding
    layout = rows_layout([(4, 3), (300,), (2, 5)], world_size=2, rank=0, direct_min_numel=10**9)
    (group,) = layout.groups
    starts = block_starts(layout, group, 0, 64)
    ranges = [layout.local_range(i, 0) for i in range(3)]
    firsts = [start - group.shard_offset for start, _ in ranges]
    ends = [end - group.shard_offset for _, end in ranges]
    assert set(firsts) <= set(starts) and ends == [6, 158, 165] and set(ends) <= set(starts)
    assert all(b - a <= 64 for a, b in zip(starts, starts[1:] + [group.shard_numel]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_long_irregular_blocks_match_the_reference(backend, fmt):
    """fp32 blocks of every length from 0 to 300 values (the vectorized host kernel takes 32
    values a step and the reference's code for the rest), starting at every offset modulo 32,
    over random mantissas at every exponent and subnormal scales, with NaN, infinities, -0 and
    all-zero blocks planted: codes, scales and dequantized values bit for bit."""
    device = _device(backend)
    values = every_exponent_blocks(per_exponent=2, block=64, seed=11).reshape(-1)
    g = torch.Generator().manual_seed(5)
    lengths = torch.cat([torch.arange(301), torch.randint(0, 301, (600,), generator=g)])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(starts[-1])
    values = values[torch.randperm(values.numel(), generator=g)[:n]].clone()
    starts = starts[:-1]
    for at, planted in ((starts[500], float("nan")), (starts[520] + 31, float("inf")),
                        (starts[540] + 7, -float("inf")), (starts[560] + 33, float("nan"))):
        values[int(at)] = planted
    block = slice(int(starts[580]), int(starts[582]))
    values[block] = 0.0
    values[int(starts[590]):int(starts[591])] = -0.0
    wires = {}
    for name, dev in ((backend, device), ("torch", "cpu")):
        wire = torch.zeros(ops.slot_bytes(n, starts.numel()), dtype=torch.uint8, device=dev)
        ops.quantize_into(values.to(dev), wire, starts.to(dev), fmt, backend=name)
        wires[name] = wire.cpu()
    nan = wires["torch"][(n + 15) // 16 * 16:][:4 * starts.numel()].view(torch.float32).isnan()
    assert nan.sum() == 4
    assert torch.equal(wires[backend], wires["torch"])
    out, expected = torch.empty(n, device=device), torch.empty(n)
    ops.dequantize_from(wires["torch"].to(device), out, starts.to(device), fmt, backend=backend)
    ops.dequantize_from(wires["torch"], expected, starts, fmt, backend="torch")
    assert torch.equal(out.cpu().isnan(), expected.isnan())
    kept = ~expected.isnan()
    assert torch.equal(out.cpu().view(torch.int32)[kept], expected.view(torch.int32)[kept])


def _blocks_of_every_length(g: torch.Generator):
    """(starts, n, nblocks): blocks of every length 0-100, then 100 of random lengths."""
    lengths = torch.cat([torch.arange(101), torch.randint(0, 101, (100,), generator=g)])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return starts[:-1], int(starts[-1]), lengths.numel()


def _scales_of_every_kind(nblocks: int, g: torch.Generator, first: int, every: int):
    """nblocks fp32 scales over the whole exponent range, and from block `first` on, at every
    `every`-th block, one of 0, -0, subnormals, 1, -2.5, huge, +-inf and NaN in turn."""
    specials = torch.tensor([0.0, -0.0, 1e-45, 3e-39, 1.0, -2.5, 3e38, float("inf"),
                             -float("inf"), float("nan")])
    scales = torch.randn(nblocks, generator=g) * 10.0 ** torch.randint(-40, 38, (nblocks,),
                                                                        generator=g)
    picked = scales[first::every]
    scales[first::every] = specials.repeat(picked.numel() // specials.numel() + 1)[
        :picked.numel()]
    return scales


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_and_scale_dequantizes_as_the_reference(backend, fmt):
    """Slots no quantizer writes: every code byte (fp8's NaN codes 0x7F/0xFF, its subnormals, -0)
    at every lane position, under scales of every kind (0, -0, subnormal, huge, infinite, NaN),
    in blocks of every length from 0 to 100, into every dtype (the vectorized host paths): bit for
    bit, NaN where NaN."""
    device = _device(backend)
    g = torch.Generator().manual_seed(3)
    starts, n, nblocks = _blocks_of_every_length(g)
    slot = torch.zeros(ops.slot_bytes(n, nblocks), dtype=torch.uint8)
    slot[:n] = torch.arange(n) % 256
    scales = _scales_of_every_kind(nblocks, g, first=0, every=7)
    start = (n + 15) // 16 * 16
    slot[start:start + 4 * nblocks] = scales.view(torch.uint8)
    for out_dtype in DTYPES:
        out = torch.empty(n, dtype=out_dtype, device=device)
        expected = torch.empty(n, dtype=out_dtype)
        ops.dequantize_from(slot.to(device), out, starts.to(device), fmt, backend=backend)
        ops.dequantize_from(slot, expected, starts, fmt, backend="torch")
        nan = expected.isnan()
        assert torch.equal(out.cpu().isnan(), nan)
        width = torch.int32 if out_dtype == torch.float32 else torch.int16
        assert torch.equal(out.cpu().view(width)[~nan], expected.view(width)[~nan])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shift", [0, 1])
def test_irregular_blocks_of_every_dtype_match_the_reference(backend, fmt, dtype, shift):
    """Values of every dtype (the vectorized host kernels load eight a step, bf16 and fp16
    widened to fp32) in blocks of every length 0-300 and longer, NaN/inf/zero blocks planted,
    the values' address aligned and not: codes and scales bit for bit."""
    device = _device(backend)
    values, starts = irregular_quant_input(dtype, seed=3)
    values = torch.cat([values[:shift], values]).to(device)[shift:]  # address + shift elements
    n = values.numel()
    wires = {}
    for name, dev in ((backend, device), ("torch", "cpu")):
        wire = torch.zeros(ops.slot_bytes(n, starts.numel()), dtype=torch.uint8, device=dev)
        ops.quantize_into(values.to(dev), wire, starts.to(dev), fmt, backend=name)
        wires[name] = wire.cpu()
    assert torch.equal(wires[backend], wires["torch"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_every_16_bit_pattern_quantizes_as_the_reference(backend, fmt, dtype):
    """All 65536 bf16 or fp16 bit patterns (NaNs, infinities, subnormals, -0), in blocks of 8,
    16 and 33 consecutive patterns and in one whole block of each sign: codes and scales bit for
    bit."""
    device = _device(backend)
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    n = patterns.numel()
    for starts in (torch.arange(0, n, 8), torch.arange(0, n, 16), torch.arange(0, n, 33),
                   torch.tensor([0, n // 2])):
        wires = {}
        for name, dev in ((backend, device), ("torch", "cpu")):
            wire = torch.zeros(ops.slot_bytes(n, starts.numel()), dtype=torch.uint8, device=dev)
            ops.quantize_into(patterns.to(dev), wire, starts.to(dev), fmt, backend=name)
            wires[name] = wire.cpu()
        assert torch.equal(wires[backend], wires["torch"]), starts[:3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world", [1, 2, 5])
def test_every_code_and_scale_sums_as_the_reference(backend, fmt, world):
    """dequantize_sum of slots no quantizer writes: every code byte at every lane position under
    scales of every kind (0, -0, subnormal, huge, infinite, NaN), each slot's codes and scales
    different, in blocks of every length 0-100, into every dtype (sums that overflow to inf and
    inf - inf included): bit for bit, NaN where NaN."""
    device = _device(backend)
    g = torch.Generator().manual_seed(4)
    starts, n, nblocks = _blocks_of_every_length(g)
    stride = ops.slot_bytes(n, nblocks)
    wire = torch.zeros(world * stride, dtype=torch.uint8)
    first_scale = (n + 15) // 16 * 16
    for r in range(world):
        slot = wire[r * stride:(r + 1) * stride]
        slot[:n] = (torch.arange(n) * (2 * r + 1) + 37 * r) % 256
        scales = _scales_of_every_kind(nblocks, g, first=r, every=11)
        slot[first_scale:first_scale + 4 * nblocks] = scales.view(torch.uint8)
    for out_dtype in DTYPES:
        out = torch.empty(n, dtype=out_dtype, device=device)
        expected = torch.empty(n, dtype=out_dtype)
        ops.dequantize_sum(wire.to(device), out, starts.to(device), world, stride, fmt,
                           backend=backend)
        ops.dequantize_sum(wire, expected, starts, world, stride, fmt, backend="torch")
        nan = expected.isnan()
        assert torch.equal(out.cpu().isnan(), nan)
        width = torch.int32 if out_dtype == torch.float32 else torch.int16
        assert torch.equal(out.cpu().view(width)[~nan], expected.view(width)[~nan])
