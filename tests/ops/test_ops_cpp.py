"""The C++ CPU kernels (backend="cpp") against the plain-torch reference, bit for bit.

The comparison helpers take a device and a backend so tests/ops/test_ops_cuda.py runs the same cases on
CUDA tensors. Values stress rounding: normals scaled by powers of two, exact ties for bf16 and fp16,
fp16 subnormals and overflow, fp32 subnormals, +-0, +-inf and NaN (NaN must stay NaN; its payload
is not specified, so NaN positions are compared, every other value bit for bit).
"""
import itertools
import re

import pytest
import torch

import fsdp_ext.ops as ops

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="fsdp_ext._C is not built")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PAIRS = list(itertools.product(DTYPES, DTYPES))
SCALES = (1.0, 0.37)  # 0.37 is not a power of two: the scaled product itself needs rounding
DIVISORS = (1.0, 3.0, 1.5, 0.25)  # 3: world 3's; 1.5: torch's fp16 split of 3; 0.25: a power of 2
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _name(dtype):
    return str(dtype).removeprefix("torch.")


def stress_values(n, dtype, seed, device="cpu"):
    """n values of `dtype` that exercise every rounding path (built in fp32, then cast by torch)."""
    if n == 0:
        return torch.empty(0, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 31, (n,), generator=gen).float())
    mantissa = torch.randint(0, 1 << 23, (n,), generator=gen, dtype=torch.int32)
    exponent = torch.randint(103, 143, (n,), generator=gen, dtype=torch.int32)  # 2^-24 .. 2^15
    bf16_ties = ((exponent << 23) | (mantissa & ~0xFFFF) | 0x8000).view(torch.float32)
    fp16_ties = ((exponent << 23) | (mantissa & ~0x1FFF) | 0x1000).view(torch.float32)
    fp16_subnormal_ties = (torch.randint(0, 1024, (n,), generator=gen) + 0.5) * 2.0 ** -24
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.99,
                             65520.0, -65520.0, 2.0 ** -25, 2.0 ** -24, 1e-40, -1e-45, 3.4e38])
    pool = torch.cat([bf16_ties, fp16_ties, fp16_subnormal_ties])
    pick = torch.rand(n, generator=gen) < 0.5
    x[pick] = pool[torch.randint(0, len(pool), (int(pick.sum()),), generator=gen)]
    # Every special value three times (as far as n allows), at random places.
    places = torch.randperm(n, generator=gen)[:3 * len(specials)]
    x[places] = specials.repeat(3)[:len(places)]
    return x.to(dtype).to(device)


def assert_bitwise_equal(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    finite = ~actual.isnan()
    assert torch.equal(actual.view(BITS[actual.dtype])[finite], expected.view(BITS[expected.dtype])[finite])


def random_layout(numels, seed, max_gap=5):
    """Flat offsets for tensors of `numels`, placed in a shuffled order with random gaps between
    them (so list order is not flat order); returns (offsets, total flat length)."""
    gen = torch.Generator().manual_seed(seed)
    offsets, position = [0] * len(numels), 0
    for i in torch.randperm(len(numels), generator=gen).tolist():
        position += int(torch.randint(0, max_gap + 1, (1,), generator=gen))
        offsets[i] = position
        position += numels[i]
    return offsets, position


def check_pack(shapes, src_dtypes, dst_dtype, scale, window, device="cpu", backend="cpp", seed=0):
    """pack srcs of `shapes` (random layout) into the flat window (lo, hi); compare to reference."""
    numels = [int(torch.Size(s).numel()) for s in shapes]
    offsets, total = random_layout(numels, seed)
    srcs = [stress_values(n, dt, seed + i, device).reshape(s)
            for i, (n, s, dt) in enumerate(zip(numels, shapes, itertools.cycle(src_dtypes)))]
    lo, hi = window if window else (0, total)
    actual = torch.full((hi - lo,), 7.0, dtype=dst_dtype, device=device)  # zero-fill must overwrite
    expected = actual.clone()
    ops.pack(srcs, offsets, actual, lo, scale, backend=backend)
    ops.pack(srcs, offsets, expected, lo, scale, backend="torch")
    assert_bitwise_equal(actual, expected)


def check_unpack(shapes, src_dtype, dst_dtypes, window, device="cpu", backend="cpp", seed=0):
    """unpack the flat window (lo, hi) into outs of `shapes`; parts outside must stay untouched."""
    numels = [int(torch.Size(s).numel()) for s in shapes]
    offsets, total = random_layout(numels, seed)
    lo, hi = window if window else (0, total)
    src = stress_values(hi - lo, src_dtype, seed, device)
    actual = [torch.full(s, -3.0, dtype=dt, device=device)
              for s, dt in zip(shapes, itertools.cycle(dst_dtypes))]
    expected = [t.clone() for t in actual]
    ops.unpack(src, lo, offsets, actual, backend=backend)
    ops.unpack(src, lo, offsets, expected, backend="torch")
    for a, e in zip(actual, expected):
        assert_bitwise_equal(a, e)


def check_cast_into_slot(shape, src_dtype, dst_dtype, world, slot, device="cpu", backend="cpp"):
    shard = stress_values(int(torch.Size(shape).numel()), src_dtype, slot, device).reshape(shape)
    actual = torch.full((world * shard.numel(),), 5.0, dtype=dst_dtype, device=device)
    expected = actual.clone()
    ops.cast_into_slot(shard, actual, slot, backend=backend)
    ops.cast_into_slot(shard, expected, slot, backend="torch")
    assert_bitwise_equal(actual, expected)


def check_grad_epilogue(shape, src_dtype, dst_dtype, divisor, accumulate, device="cpu",
                        backend="cpp"):
    n = int(torch.Size(shape).numel())
    reduced = stress_values(n, src_dtype, 1, device).reshape(shape)
    actual = stress_values(n, dst_dtype, 2, device).reshape(shape)
    expected = actual.clone()
    ops.grad_epilogue(reduced, actual, divisor, accumulate, backend=backend)
    ops.grad_epilogue(reduced, expected, divisor, accumulate, backend="torch")
    assert_bitwise_equal(actual, expected)


# Shapes with odd sizes, a 2-D source, an empty and a 1-element tensor; windows that clip the first
# and last covered sources, leave some sources entirely outside, or cover everything.
SHAPES = [(7,), (3, 5), (0,), (1,), (33,), (2, 2, 3), (129,), (1,), (17,)]
WINDOWS = [None, (9, 150), (40, 41), (0, 0), (100, 400)]


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: _name(d))
@pytest.mark.parametrize("scale", SCALES)
def test_pack_dtype_pairs(src_dtype, dst_dtype, scale):
    for seed, window in enumerate(WINDOWS):
        check_pack(SHAPES, [src_dtype], dst_dtype, scale, window, seed=seed)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: _name(d))
def test_unpack_dtype_pairs(src_dtype, dst_dtype):
    for seed, window in enumerate(WINDOWS):
        check_unpack(SHAPES, src_dtype, [dst_dtype], window, seed=seed)


def test_mixed_dtypes_in_one_call():
    check_pack(SHAPES, DTYPES, torch.bfloat16, 0.5, (3, 170))
    check_unpack(SHAPES, torch.float32, DTYPES, (3, 170))


def test_empty_lists_and_windows():
    check_pack([], [torch.float32], torch.float32, 1.0, (0, 11))  # all zero fill
    check_pack([(5,)], [torch.float32], torch.float16, 1.0, (2, 2))
    check_unpack([], torch.float32, [torch.float32], (0, 11))


def test_thousand_tiny_tensors():
    gen = torch.Generator().manual_seed(3)
    shapes = [(int(s),) for s in torch.randint(0, 20, (1000,), generator=gen) * 2 + 1]
    check_pack(shapes, DTYPES, torch.float32, 1.0, None, seed=5)
    check_pack(shapes, [torch.float32], torch.bfloat16, 0.25, (1234, 9000), seed=6)
    check_unpack(shapes, torch.bfloat16, DTYPES, (77, 12001), seed=7)


def test_large_tensors_split_across_threads():
    # Every op above the parallel grain (32 MiB moved: 4-6M elements for these dtype pairs), the
    # pack window clipping both ends; then 4 MB of fp32 (below the grain: one thread).
    big = 6 << 20
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # also where the machine has one core
    try:
        _large_cases(big)
    finally:
        torch.set_num_threads(threads)


def _large_cases(big):
    check_pack([(big,), (1 << 16,)], [torch.float32], torch.bfloat16, 1.0, (1000, big + 5))
    # Same-dtype calls that write 16 MiB or more use streaming stores: runs whose destinations
    # start at odd offsets (random gaps), split between threads mid-run, and the unaligned tails.
    check_pack([(big,)], [torch.float32], torch.float32, 1.0, None)
    check_pack([(big + 3,), ((1 << 20) + 1,), (5,)], [torch.float32], torch.float32, 1.0, None,
               seed=8)
    check_unpack([(big + 1,), (33,), ((1 << 20) + 7,)], torch.float32, [torch.float32], None, seed=9)
    check_cast_into_slot((big + 1,), torch.float32, torch.float32, 2, 1)
    check_unpack([(big,)], torch.bfloat16, [torch.float32], (3, big))
    check_cast_into_slot((big + 3,), torch.float32, torch.float16, 2, 1)
    check_grad_epilogue(((4 << 20) + 1,), torch.bfloat16, torch.float32, 3.0, True)
    check_pack([(1 << 20,), (1 << 16,)], [torch.float32], torch.bfloat16, 1.0, (1000, (1 << 20) + 5))


def test_copy_sizes_around_the_vector_paths():
    # Same-dtype copies: under 32 bytes (memcpy), 32 bytes and up (vector moves, 128-byte steps
    # and an overlapping last move), 1 MiB and up (memcpy again); each at every alignment of the
    # destination against the source (the random gaps shift the flat offsets).
    numels = [1, 7, 8, 9, 31, 32, 33, 40, 63, 64, 65, 1000, 4097, (1 << 18) + 3]
    for dtype in (torch.float32, torch.bfloat16):
        for seed in range(2):
            shapes = [(n,) for n in numels]
            check_pack(shapes, [dtype], dtype, 1.0, None, seed=seed)
            check_unpack(shapes, dtype, [dtype], None, seed=seed)


def test_errors_name_the_tensor_deep_in_a_long_list():
    srcs = [_t(3) for _ in range(1000)]
    offsets = [3 * i for i in range(1000)]
    out = _t(3000)
    bad_tensors = [(737, _t(3, 2).t()), (999, _t(3, dtype=torch.int32)), (500, _t(3, device="meta"))]
    for i, bad in bad_tensors:
        with pytest.raises(ValueError, match=re.escape(f"srcs[{i}]")):
            ops.pack(srcs[:i] + [bad] + srcs[i + 1:], offsets, out, backend="cpp")
    with pytest.raises(ValueError, match=re.escape("offsets[998]: must be >= 0")):
        ops.pack(srcs, offsets[:998] + [-3] + offsets[999:], out, backend="cpp")
    # In list order up to one tensor that overlaps its predecessor.
    with pytest.raises(ValueError, match=re.escape("srcs[401] overlaps srcs[400]")):
        ops.pack(srcs, offsets[:401] + [offsets[400] + 2] + offsets[402:], out, backend="cpp")
    with pytest.raises(ValueError, match=re.escape("outs[0] overlaps outs[999]")):
        ops.unpack(out, 0, [offsets[-1] + 1] + offsets[1:], srcs, backend="cpp")


def test_offsets_and_lists_of_any_sequence_type():
    srcs = [torch.arange(3.0), torch.arange(2.0) + 10]
    expected = torch.tensor([10.0, 11.0, 0.0, 1.0, 2.0, 0.0])
    for offsets in ([2, 0], (2, 0), iter([2, 0]), torch.tensor([2, 0]).tolist(), range(2, -1, -2)):
        out = torch.full((6,), 5.0)
        ops.pack(tuple(srcs), offsets, out, backend="cpp")
        assert torch.equal(out, expected)
    outs = [torch.empty(3), torch.empty(2)]
    ops.unpack(expected, 0, (2, 0), iter(outs), backend="cpp")
    assert torch.equal(outs[0], torch.arange(3.0)) and torch.equal(outs[1], srcs[1])


def test_calls_from_many_python_threads():
    # The kernels take the GIL once to hand their list arguments back to Python (see
    # csrc/boxed_args.h); threads calling at once must neither deadlock nor mix up results.
    import threading

    errors = []

    def work(seed):
        try:
            for k in range(30):
                shapes = [(n,) for n in range(1, 60)]
                check_pack(shapes, [torch.float32], torch.bfloat16, 0.5, None, seed=seed * 100 + k)
                check_unpack(shapes, torch.float32, [torch.float16], None, seed=seed * 100 + k)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: _name(d))
def test_cast_into_slot(src_dtype, dst_dtype):
    for shape, world in [((3, 7), 4), ((1,), 1), ((0,), 3), ((1001,), 2)]:
        for slot in {0, world - 1}:
            check_cast_into_slot(shape, src_dtype, dst_dtype, world, slot)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: _name(d))
@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_grad_epilogue(src_dtype, dst_dtype, divisor, accumulate):
    for shape in [(4, 33), (1,), (0,), (1001,)]:
        check_grad_epilogue(shape, src_dtype, dst_dtype, divisor, accumulate)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_grad_epilogue_divides_as_torch(backend, reduce_dtype):
    """The post-divide is torch's: `reduced / divisor` in the reduce dtype (what FSDP2 and gloo's
    AVG do), then cast and added, not a multiply by 1 / divisor (which at divisor 3 is up to an
    ulp off in a third of the values)."""
    reduced = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-3).to(
        reduce_dtype)
    old = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    for divisor in (3.0, 6.0, 1.5, 2.0):
        out = torch.empty(4096)
        ops.grad_epilogue(reduced, out, divisor, False, backend=backend)
        assert torch.equal(out, (reduced / divisor).float()), divisor
        out = old.clone()
        ops.grad_epilogue(reduced, out, divisor, True, backend=backend)
        assert torch.equal(out, old + (reduced / divisor).float()), divisor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_pattern_widens_exactly(dtype):
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    actual, expected = torch.empty(len(every)), torch.empty(len(every))
    ops.pack([every], [0], actual, backend="cpp")
    ops.pack([every], [0], expected, backend="torch")
    assert_bitwise_equal(actual, expected)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_rounding_patterns_match_torch(dtype):
    """Every sign and exponent with every pattern of the low 17 mantissa bits (all that rounding
    to bf16 looks at, and to fp16 outside its subnormals), under two patterns of the high bits:
    all ones (rounding carries into the exponent) and 0b010110."""
    low = torch.arange(1 << 17, dtype=torch.int64)
    for high in (0x3F, 0x16):
        for first in range(0, 512, 32):  # 32 sign/exponent values, 4M floats per call
            top = (torch.arange(first, first + 32, dtype=torch.int64) << 23) | (high << 17)
            values = (top[:, None] | low).reshape(-1).to(torch.int32).view(torch.float32)
            actual, expected = torch.empty(len(values), dtype=dtype), values.to(dtype)
            ops.pack([values], [0], actual, backend="cpp")
            nan = actual.isnan()  # compared without assert_close, which is slow at this size
            assert torch.equal(nan, expected.isnan())
            assert torch.equal(actual.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nan_payloads_agree_between_vector_and_scalar_code(dtype):
    """NaN payloads are not specified (NaN must stay NaN), but the vector casts keep the scalar
    code's choice (quiet, sign and top payload bits kept): 30 values, so each pattern lands in
    vector steps (16 lanes for bf16, 8 for fp16) and, in the last 6, in the scalar tail. For fp16
    that choice is also torch's."""
    patterns = [0x7F800001, 0x7FC00000, -0x003FFFFF, 0x7FFFFFFF, 0x7FA02000, -0x007FE000]
    x = torch.tensor(patterns * 5, dtype=torch.int32).view(torch.float32)
    actual = torch.empty(len(x), dtype=dtype)
    ops.pack([x], [0], actual, backend="cpp")
    bits = actual.view(torch.int16).reshape(5, len(patterns))
    assert actual.isnan().all() and (bits == bits[-1]).all(), bits  # the last row: the scalar tail
    if dtype == torch.float16:
        assert torch.equal(actual.view(torch.int16), x.to(dtype).view(torch.int16))


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


# (op, arguments, the name the error must mention). A 'meta' tensor stands in for a wrong device.
ERROR_CASES = {
    "pack overlapping sources": (ops.pack, lambda: ([_t(4), _t(4)], [0, 2], _t(8)), "srcs[1]"),
    "pack wrong device": (ops.pack, lambda: ([_t(4, device="meta")], [0], _t(8)), "srcs[0]"),
    "pack non-contiguous": (ops.pack, lambda: ([_t(3, 4).t()], [0], _t(12)), "srcs[0]"),
    "pack int source": (ops.pack, lambda: ([_t(4, dtype=torch.int32)], [0], _t(8)), "srcs[0]"),
    "pack int out": (ops.pack, lambda: ([_t(4)], [0], _t(8, dtype=torch.int64)), "out"),
    "pack 2-D out": (ops.pack, lambda: ([_t(4)], [0], _t(2, 4)), "out"),
    "pack negative offset": (ops.pack, lambda: ([_t(4)], [-1], _t(8)), "offsets[0]"),
    "pack negative out_offset": (ops.pack, lambda: ([_t(4)], [0], _t(8), -2), "out_offset"),
    "pack length mismatch": (ops.pack, lambda: ([_t(4), _t(1)], [0], _t(8)), "offsets"),
    "unpack overlapping outs": (ops.unpack, lambda: (_t(8), 0, [3, 0], [_t(2), _t(4)]), "outs[0]"),
    "unpack wrong device": (ops.unpack, lambda: (_t(8), 0, [0], [_t(2, device="meta")]), "outs[0]"),
    "unpack non-contiguous": (ops.unpack, lambda: (_t(8), 0, [0], [_t(2, 3).t()]), "outs[0]"),
    "unpack int source": (ops.unpack, lambda: (_t(8, dtype=torch.int16), 0, [0], [_t(2)]), "src"),
    "unpack negative src_offset": (ops.unpack, lambda: (_t(8), -1, [0], [_t(2)]), "src_offset"),
    "slot out of range": (ops.cast_into_slot, lambda: (_t(4), _t(10), 2), "slot 2"),
    "negative slot": (ops.cast_into_slot, lambda: (_t(4), _t(10), -1), "slot"),
    "slot int shard": (ops.cast_into_slot, lambda: (_t(4, dtype=torch.int8), _t(8), 0), "shard"),
    "slot non-contiguous gathered": (ops.cast_into_slot, lambda: (_t(4), _t(16)[::2], 0), "gathered"),
    "slot wrong device": (ops.cast_into_slot, lambda: (_t(4, device="meta"), _t(8), 0), "shard"),
    "epilogue size mismatch": (ops.grad_epilogue, lambda: (_t(4), _t(5)), "reduced"),
    "epilogue int out": (ops.grad_epilogue, lambda: (_t(4), _t(4, dtype=torch.int32)), "out"),
    "epilogue wrong device": (ops.grad_epilogue, lambda: (_t(4, device="meta"), _t(4)), "reduced"),
    "epilogue non-contiguous": (ops.grad_epilogue, lambda: (_t(2, 2).t(), _t(4)), "reduced"),
}


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_arguments_are_named(case, backend):
    op, make_args, name = ERROR_CASES[case]
    with pytest.raises(ValueError, match=re.escape(name)):
        op(*make_args(), backend=backend)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_gathered_must_be_flat(backend):
    # The reference slices dim 0, which is a flat slot only for a 1-D buffer; every backend insists
    # (the torch backend's check is also the one Triton runs), with the same message.
    with pytest.raises(ValueError, match=re.escape("gathered: must be 1-D")):
        ops.cast_into_slot(_t(2), _t(2, 4), 0, backend=backend)


def opcheck_samples(device="cpu"):
    """(op, args) per op; a fp32 input requires grad so the autograd registration test runs."""
    grad = dict(device=device, requires_grad=True)
    srcs = [torch.randn(3, 4, **grad), torch.randn(5, device=device).bfloat16()]
    outs = [torch.zeros(3, 4, device=device), torch.zeros(5, dtype=torch.float16, device=device)]
    f = torch.ops.fsdp_ext
    return [
        (f.pack.default, (srcs, [2, 20], torch.zeros(20, device=device), 1, 0.5)),
        (f.unpack.default, (torch.randn(30, **grad), 3, [0, 14], outs)),
        (f.cast_into_slot.default, (torch.randn(2, 3, **grad), torch.zeros(24, device=device).half(), 2)),
        (f.grad_epilogue.default, (torch.randn(6, **grad), torch.randn(2, 3, device=device), 0.25, True)),
    ]


@pytest.mark.parametrize("index", range(4), ids=["pack", "unpack", "cast_into_slot", "grad_epilogue"])
def test_opcheck(index):
    op, args = opcheck_samples()[index]
    torch.library.opcheck(op, args)


# ---- the vector switch (csrc/cpu_vector.h): both paths tested on one machine ----------------------
def _paths() -> dict:
    import fsdp_ext._C as C
    return C.cpu_vector_paths()


def test_vector_switch_says_which_path_ran():
    """FSDP_EXT_CPU_VECTOR (read once per process): unset or auto, the AVX2 paths run where the
    CPU has AVX2; 0, the scalar paths alone. The dispatch counters show which ran for a cast
    (fp32 -> bf16 and -> fp16), a same-dtype copy and an epilogue; the suite's own run and the
    scalar rerun (test_kernel_suites_pass_on_the_scalar_paths) each assert their own."""
    import os
    mode = os.environ.get("FSDP_EXT_CPU_VECTOR", "") or "auto"
    before = _paths()
    src = torch.randn(4096)
    for dst_dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = torch.empty(4096 + 64, dtype=dst_dtype)
        ops.pack([src, src[:64]], [0, 4096], out, 0, 0.37)
        ops.pack([src], [0], out, 0, 1.0)
    ops.grad_epilogue(torch.randn(4096, dtype=torch.bfloat16), torch.zeros(4096), 3.0, True)
    after = _paths()
    assert after["mode"] == mode, after
    vector, scalar = (after[k] - before[k] for k in ("vector_calls", "scalar_calls"))
    if after["avx2"]:
        assert mode != "0" and after["cpu_avx2"], after
        assert vector >= 4 and scalar == 0, (vector, scalar, after)
    else:
        assert mode == "0" or not after["cpu_avx2"], after
        assert vector == 0 and scalar >= 4, (vector, scalar, after)


KERNEL_SUITES = ["tests/ops/test_ops_cpp.py", "tests/ops/test_ops_quantized.py"]
_VECTOR_RUN = ops.HAVE_EXTENSION and _paths()["avx2"]


@pytest.mark.skipif(not _VECTOR_RUN, reason="this run is already on the scalar paths (no AVX2, "
                    "or FSDP_EXT_CPU_VECTOR=0)")
def test_kernel_suites_pass_on_the_scalar_paths():
    """The CPU kernels' suites again with FSDP_EXT_CPU_VECTOR=0: on an AVX2 machine the auto
    run tests the vector paths only, so this is where the scalar ones (what a CPU without AVX2
    runs) meet the reference, bit for bit."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--heartbeat-s", "0",
         *KERNEL_SUITES], cwd=root, env={**os.environ, "FSDP_EXT_CPU_VECTOR": "0"},
        capture_output=True, text=True, timeout=600)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail.splitlines()[-1], tail
