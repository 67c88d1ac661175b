"""Triton kernels against the plain-torch reference, bit for bit.

Without a GPU the kernels run in Triton's interpreter. TRITON_INTERPRET must be set before
`@triton.jit` decorates them (and best before triton is first imported), hence at the very top.
Pytest imports every test module before running any, so the variable is visible to the whole
session; that is harmless here (only these tests use Triton on CPU), and a module fixture restores
it after this module's tests. Set TRITON_INTERPRET=0 on a CUDA machine to test the compiled
kernels instead.
"""
import os

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from fsdp_ext import ops  # noqa: E402

INTERPRET = bool(triton.knobs.runtime.interpret)
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is off and there is no GPU", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
# The interpreter evaluates with numpy, which warns on inf * 0 and inf - inf (NaN expected there).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_PAIRS = list(itertools.product(DTYPES, DTYPES))
SCALES = (1.0, -0.37)
DIVISORS = (1.0, 3.0, -1.5, 4.0)
_INT_OF_WIDTH = {4: torch.int32, 2: torch.int16}


@pytest.fixture(scope="module", autouse=True)
def _restore_interpret_variable():
    yield
    if _PREVIOUS_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal values, NaN where NaN (payloads may differ), equal bits elsewhere (so -0 != +0)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    width = _INT_OF_WIDTH[expected.element_size()]
    assert torch.equal(actual.view(width)[~nan], expected.view(width)[~nan])


def assert_identical_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Every bit equal, NaN signs and payloads included."""
    width = _INT_OF_WIDTH[expected.element_size()]
    differ = actual.view(width) != expected.view(width)
    assert not bool(differ.any()), (
        f"{int(differ.sum())} elements differ, e.g. {actual[differ][:4].tolist()} "
        f"(bits {actual.view(width)[differ][:4].tolist()}) vs "
        f"{expected[differ][:4].tolist()} (bits {expected.view(width)[differ][:4].tolist()})")


def stress_values(n: int, seed: int = 0) -> torch.Tensor:
    """fp32 values that stress rounding: for every exponent, mantissas at and around the bf16 and
    fp16 (normal and subnormal) rounding ties, both signs; plus random bit patterns (NaNs, infs,
    subnormals) and ordinary normals. Shuffled, first n."""
    exponents = torch.arange(256, dtype=torch.int32) << 23
    low = torch.tensor([0, 1, 0xFFF, 0x1000, 0x1001, 0x3000, 0x7FFF, 0x8000, 0x8001, 0x18000,
                        0x7FFFFF, 0x7FF000], dtype=torch.int32)
    high = torch.tensor([0, 1 << 13, 1 << 16, 0x7FE000], dtype=torch.int32)
    structured = (exponents[:, None, None] | low[None, :, None] | high[None, None, :]).reshape(-1)
    structured = torch.cat([structured, structured | torch.iinfo(torch.int32).min])
    gen = torch.Generator().manual_seed(seed)
    random_bits = torch.randint(-2**31, 2**31, (4096,), generator=gen, dtype=torch.int64).int()
    values = torch.cat([structured.view(torch.float32), random_bits.view(torch.float32),
                        torch.randn(4096, generator=gen) * 70000,
                        torch.tensor([65504.0, 65519.996, 65520.0, 2.0**-24, 2.0**-25, 0.0, -0.0])])
    return values[torch.randperm(values.numel(), generator=gen)][:n].to(DEVICE)


def every_16bit_pattern(dtype: torch.dtype) -> torch.Tensor:
    """All 65536 bf16 or fp16 values, NaNs and infs included."""
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype).to(DEVICE)


def make_sources(sizes, dtypes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * 3).to(dt).to(DEVICE) for s, dt in zip(sizes, dtypes)]


def run_both(op, *args_per_backend):
    """Call `op` with backend triton on the first argument set and torch on the second."""
    op(*args_per_backend[0], backend="triton")
    op(*args_per_backend[1], backend="torch")


# Sources with gaps between them, out of order, an empty and a one-element tensor, and sizes that
# are not multiples of the kernel block (1024). Flat span: [0, 5200).
SIZES = [700, 0, 1, 2500, 33, 3]
OFFSETS = [4500, 10, 10, 1200, 20, 3900]
# Windows (start, length): the whole span, clipped at both ends, inside one source, inside a gap,
# a single element, and empty.
WINDOWS = [(0, 5200), (1500, 3100), (1300, 900), (3800, 50), (10, 1), (100, 0)]


@pytest.mark.parametrize("src_dtype,out_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("scale", SCALES)
def test_pack_matches_reference(src_dtype, out_dtype, scale):
    srcs = make_sources(SIZES, [src_dtype] * len(SIZES))
    for start, length in WINDOWS:
        # Pre-filled: pack must overwrite every element, gaps included.
        got = torch.full((length,), 7.0, dtype=out_dtype, device=DEVICE)
        want = got.clone()
        run_both(ops.pack, (srcs, OFFSETS, got, start, scale), (srcs, OFFSETS, want, start, scale))
        assert_same_bits(got, want)


@pytest.mark.parametrize("src_dtype,out_dtype", DTYPE_PAIRS)
def test_unpack_matches_reference(src_dtype, out_dtype):
    for start, length in WINDOWS:
        src = (torch.randn(length) * 3).to(src_dtype).to(DEVICE)
        # Sentinel contents: elements outside the window must stay untouched.
        got = [torch.full((s,), -5.0, dtype=out_dtype, device=DEVICE) for s in SIZES]
        want = [t.clone() for t in got]
        run_both(ops.unpack, (src, start, OFFSETS, got), (src, start, OFFSETS, want))
        for g, w in zip(got, want):
            assert_same_bits(g, w)


def test_pack_and_unpack_mixed_dtypes_and_shapes():
    """Sources of different dtypes and ranks in one launch; unpack into different dtypes."""
    srcs = make_sources([6, 1000, 129, 2048], [torch.bfloat16, torch.float32, torch.float16,
                                               torch.float32])
    srcs[1] = srcs[1].view(10, 100)
    srcs[3] = srcs[3].view(2, 32, 32)
    offsets = [3300, 0, 1100, 1229]
    for out_dtype in DTYPES:
        got = torch.empty(3400, dtype=out_dtype, device=DEVICE)
        want = got.clone()
        run_both(ops.pack, (srcs, offsets, got, 0, 0.5), (srcs, offsets, want, 0, 0.5))
        assert_same_bits(got, want)
        outs = [torch.zeros_like(s) for s in srcs]
        outs_ref = [o.clone() for o in outs]
        run_both(ops.unpack, (got[1000:], 1000, offsets, outs),
                 (want[1000:], 1000, offsets, outs_ref))
        for g, w in zip(outs, outs_ref):
            assert_same_bits(g, w)


def test_many_small_tensors():
    """200 tensors of odd sizes: blocks that straddle many segments (per-lane segment search)."""
    gen = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 40, (200,), generator=gen).tolist()
    dtypes = [DTYPES[i % 3] for i in range(200)]
    srcs = make_sources(sizes, dtypes, seed=2)
    offsets, cursor = [], 0
    for s in sizes:
        cursor += s % 3  # small gaps, sometimes none
        offsets.append(cursor)
        cursor += s
    order = torch.randperm(200, generator=gen).tolist()  # offsets need not come in flat order
    srcs, offsets = [srcs[i] for i in order], [offsets[i] for i in order]
    for out_dtype in (torch.float32, torch.bfloat16):
        for start, length in ((0, cursor), (555, cursor - 1000)):
            got = torch.full((length,), 9.0, dtype=out_dtype, device=DEVICE)
            want = got.clone()
            run_both(ops.pack, (srcs, offsets, got, start, 2.0), (srcs, offsets, want, start, 2.0))
            assert_same_bits(got, want)
            outs = [torch.full_like(s, 4.0) for s in srcs]
            outs_ref = [o.clone() for o in outs]
            run_both(ops.unpack, (got, start, offsets, outs), (want, start, offsets, outs_ref))
            for g, w in zip(outs, outs_ref):
                assert_same_bits(g, w)


@pytest.mark.parametrize("src_dtype,dst_dtype", DTYPE_PAIRS)
def test_cast_into_slot_matches_reference(src_dtype, dst_dtype):
    for numel, slot, slots in ((1500, 2, 4), (1, 0, 3), (0, 1, 2)):
        shard = (torch.randn(numel) * 3).to(src_dtype).to(DEVICE)
        got = torch.full((numel * slots,), 8.0, dtype=dst_dtype, device=DEVICE)
        want = got.clone()
        run_both(ops.cast_into_slot, (shard, got, slot), (shard, want, slot))
        assert_same_bits(got, want)


@pytest.mark.parametrize("reduced_dtype,out_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize("accumulate", (False, True))
def test_grad_epilogue_matches_reference(reduced_dtype, out_dtype, divisor, accumulate):
    for shape in ((37, 41), (1,), (0,)):
        reduced = (torch.randn(shape) * 3).to(reduced_dtype).to(DEVICE)
        got = torch.randn(shape).to(out_dtype).to(DEVICE)
        want = got.clone()
        run_both(ops.grad_epilogue, (reduced, got, divisor, accumulate),
                 (reduced, want, divisor, accumulate))
        assert_same_bits(got, want)


@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_rounding_of_awkward_values(dst_dtype):
    """Ties to even, subnormals, fp16 overflow, inf and NaN: through every op that rounds."""
    values = stress_values(40000)
    n = values.numel()
    for src in (values, every_16bit_pattern(torch.bfloat16), every_16bit_pattern(torch.float16)):
        got = torch.zeros(src.numel(), dtype=dst_dtype, device=DEVICE)
        want = got.clone()
        run_both(ops.cast_into_slot, (src, got, 0), (src, want, 0))
        assert_same_bits(got, want)
        if ops.HAVE_EXTENSION and INTERPRET:  # NaNs too: the C++ kernels' exact bits
            cpp = torch.zeros_like(got)
            ops.cast_into_slot(src, cpp, 0, backend="cpp")
            assert_identical_bits(got, cpp)
    halves = [values[: n // 2], values[n // 2:]]
    for scale in (1.0, 3.0e-3):
        got = torch.zeros(n + 10, dtype=dst_dtype, device=DEVICE)
        want = got.clone()
        run_both(ops.pack, (halves, [n // 2 + 10, 0], got, 0, scale),
                 (halves, [n // 2 + 10, 0], want, 0, scale))
        assert_same_bits(got, want)
    outs = [torch.zeros(n // 2, dtype=dst_dtype, device=DEVICE) for _ in range(2)]
    outs_ref = [o.clone() for o in outs]
    run_both(ops.unpack, (values, 0, [0, n // 2], outs), (values, 0, [0, n // 2], outs_ref))
    for g, w in zip(outs, outs_ref):
        assert_same_bits(g, w)
    base = stress_values(n, seed=1).to(dst_dtype)
    got, want = base.clone(), base.clone()
    run_both(ops.grad_epilogue, (values, got, -3.0, True), (values, want, -3.0, True))
    assert_same_bits(got, want)


@pytest.mark.parametrize("dtype,fmt", [
    (torch.float32, "int8"), (torch.bfloat16, "fp8"),
    *(pytest.param(d, f, marks=pytest.mark.slow) for d, f in (
        (torch.float32, "fp8"), (torch.bfloat16, "int8"), (torch.float16, "int8"),
        (torch.float16, "fp8")))])
def test_quantized_collectives_match_reference(dtype, fmt):
    """quantize_into / dequantize_from / dequantize_sum: irregular blocks (longer than a chunk
    of lanes, and shorter), a block of zeros, a NaN block, ties; bytes and values bit for bit."""
    n, world = 1300, 3
    starts = torch.tensor([0, 300, 301, 700, 1000, 1290], device=DEVICE)
    values = (torch.randn(world * n) * torch.logspace(-4, 3, world * n)).to(dtype).to(DEVICE)
    values[310:400] = 0.0
    values[n + 5] = float("nan")
    values[2 * n + 702] = values[2 * n + 701] * 0.5  # and whatever ties the data holds
    stride = ops.slot_bytes(n, starts.numel())
    wires = {}
    for backend in ("triton", "torch"):
        wire = torch.zeros(world * stride, dtype=torch.uint8, device=DEVICE)
        for r in range(world):
            ops.quantize_into(values[r * n:(r + 1) * n], wire.narrow(0, r * stride, stride),
                              starts, fmt, backend=backend)
        wires[backend] = wire
    assert torch.equal(wires["triton"], wires["torch"])
    for out_dtype in DTYPES:
        got = torch.empty(n, dtype=out_dtype, device=DEVICE)
        want = torch.empty_like(got)
        run_both(ops.dequantize_from, (wires["torch"][stride:2 * stride], got, starts, fmt),
                 (wires["torch"][stride:2 * stride], want, starts, fmt))
        assert_same_bits(got, want)
        run_both(ops.dequantize_sum, (wires["torch"], got, starts, world, stride, fmt),
                 (wires["torch"], want, starts, world, stride, fmt))
        assert_same_bits(got, want)


def test_fp8_codes_of_every_float_that_rounds_into_range():
    """The bit-level fp32 -> float8_e4m3fn conversion against torch's, over every e4m3fn value
    and the midpoints between neighbours (the ties), both signs."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[codes.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    x = torch.cat([finite, mids, -finite, -mids])
    x = x[x.abs() <= 448]
    # one block holding 448 too, so its scale is exactly 1: each code is the conversion of the
    # value itself
    pinned = torch.cat([x, torch.tensor([448.0])]).to(DEVICE)
    starts = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    wire = torch.zeros(ops.slot_bytes(pinned.numel(), starts.numel()), dtype=torch.uint8,
                       device=DEVICE)
    ref = wire.clone()
    ops.quantize_into(pinned, wire, starts, "fp8", backend="triton")
    ops.quantize_into(pinned, ref, starts, "fp8", backend="torch")
    assert torch.equal(wire, ref)


@pytest.mark.parametrize("fmt", [pytest.param("int8", marks=pytest.mark.slow), "fp8"])
def test_quantized_subnormal_scales_match_reference(fmt):
    """Blocks at every 16th exponent and with subnormal amaxes whose scale keeps few bits (k *
    2^-149 for every 10th k in [200, 1200): fp8 quotients above 448, which saturate), drawn as
    the C++ test of every exponent (tests/ops/test_ops_quantized.py) draws them, a sample the
    interpreter runs in seconds (a program per block): codes, scales and values bit for bit."""
    from .test_ops_quantized import every_exponent_blocks
    blocks = every_exponent_blocks(per_exponent=1, block=16, seed=7)
    values = torch.cat([blocks[:255:16], blocks[255 + 200:255 + 1200:10]]).reshape(-1).to(DEVICE)
    n = values.numel()
    starts = torch.arange(0, n, 16, device=DEVICE)
    wires = {}
    for backend in ("triton", "torch"):
        wire = torch.zeros(ops.slot_bytes(n, starts.numel()), dtype=torch.uint8, device=DEVICE)
        ops.quantize_into(values, wire, starts, fmt, backend=backend)
        wires[backend] = wire
    assert torch.equal(wires["triton"], wires["torch"])
    got, want = torch.empty(n, device=DEVICE), torch.empty(n, device=DEVICE)
    run_both(ops.dequantize_from, (wires["torch"], got, starts, fmt),
             (wires["torch"], want, starts, fmt))
    assert_identical_bits(got, want)


def test_opcheck():
    """Schema, fake and autograd registration of the ops. cast_into_slot and grad_epilogue are
    triton_ops whose fake kernel is their body: in the interpreter that body would run the kernel
    on fake tensors, so only their schema is checked there."""
    from fsdp_ext.ops import triton_kernels  # noqa: F401  (registers torch.ops.fsdp_ext.triton_*)

    fsdp = torch.ops.fsdp_ext
    srcs = make_sources([5, 7], [torch.float32, torch.bfloat16])
    f32 = dict(device=DEVICE)
    torch.library.opcheck(fsdp.triton_pack, (srcs, [0, 6], torch.empty(20, dtype=torch.float16,
                                                                        device=DEVICE), 0, 0.5))
    torch.library.opcheck(fsdp.triton_unpack, (torch.randn(20, **f32), 0, [0, 6],
                                               [torch.empty(5, **f32), torch.empty(7, **f32)]))
    utils = ("test_schema", "test_autograd_registration") if INTERPRET else None
    kwargs = {"test_utils": utils} if utils else {}
    torch.library.opcheck(fsdp.triton_cast_into_slot, (torch.randn(5, **f32),
                          torch.empty(10, dtype=torch.bfloat16, device=DEVICE), 1), **kwargs)
    torch.library.opcheck(fsdp.triton_grad_epilogue, (srcs[1], torch.randn(7, **f32), 0.5, True),
                          **kwargs)


# Compiles, ahead of time, every kernel variant the ops can launch (every dtype kind and constexpr
# flag; `n` as triton specializes it: i32, and i64 for windows of 2**31 elements and more) for
# Ampere (sm_80) and Hopper (sm_90), with no GPU: catches code that the permissive interpreter
# accepts but the compiler rejects, and checks the epilogue really has no fma.
_GPU_COMPILE_SCRIPT = r"""
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fsdp_ext.ops import triton_kernels as tk
from fsdp_ext.ops import triton_quant as tq

BLOCK = tk.BLOCK_SIZE
bits = {0: "*i32", 1: "*i16", 2: "*i16"}
variants = []  # (kernel, signature, constexprs, options)
for n_type in ("i32", "i64"):
    for kind, other in itertools.product(range(3), range(3)):
        variants.append((tk._cast_kernel, {"src_ptr": bits[kind], "dst_ptr": bits[other],
                         "n": n_type}, {"SRC_KIND": kind, "DST_KIND": other, "BLOCK": BLOCK}, {}))
    for kind, scaled in itertools.product(range(3), (False, True)):
        variants.append((tk._pack_kernel, {"table_ptr": "*i64", "table_stride": "i32",
                         "out_ptr": bits[kind], "n": n_type, "scale": "fp32"},
                         {"OUT_KIND": kind, "APPLY_SCALE": scaled, "BLOCK": BLOCK}, {}))
    for kind in range(3):
        variants.append((tk._unpack_kernel, {"src_ptr": bits[kind], "table_ptr": "*i64",
                         "table_stride": "i32", "n": n_type}, {"SRC_KIND": kind, "BLOCK": BLOCK},
                         {}))
    for kind, other, scaled, acc in itertools.product(range(3), range(3), (False, True),
                                                      (False, True)):
        variants.append((tk._epilogue_kernel, {"reduced_ptr": bits[kind], "out_ptr": bits[other],
                         "n": n_type, "divisor": "fp32"}, {"IN_KIND": kind, "OUT_KIND": other,
                         "DIVIDE": scaled, "ACCUMULATE": acc, "BLOCK": BLOCK},
                         {"enable_fp_fusion": False}))
    for kind, fp8 in itertools.product(range(3), (False, True)):
        variants.append((tq._quantize_kernel, {"src_ptr": bits[kind], "slot_ptr": "*u8",
                         "starts_ptr": "*i64", "nblocks": "i32", "n": n_type, "scales_at": "i32"},
                         {"SRC_KIND": kind, "FP8": fp8, "BLOCK": tq.BLOCK}, {}))
        for summed in (False, True):
            variants.append((tq._dequantize_kernel, {"wire_ptr": "*u8", "out_ptr": bits[kind],
                             "starts_ptr": "*i64", "nblocks": "i32", "n": n_type,
                             "scales_at": "i32", "world": "i32", "stride": "i32"},
                             {"OUT_KIND": kind, "FP8": fp8, "SUM": summed, "BLOCK": tq.BLOCK},
                             {"enable_fp_fusion": False}))
compiled = 0
for capability in (80, 90):
    target = GPUTarget("cuda", capability, 32)
    for fn, signature, constexprs, options in variants:
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=target, options=options)
        assert kernel.asm["cubin"], (fn.__name__, constexprs)
        if fn is tk._epilogue_kernel and constexprs["DIVIDE"] and constexprs["ACCUMULATE"]:
            assert "fma" not in kernel.asm["ptx"], "the epilogue must round the quotient first"
        if fn is tq._dequantize_kernel and constexprs["SUM"]:
            assert "fma" not in kernel.asm["ptx"], "the sum must round each product first"
        compiled += 1
print("compiled", compiled)
"""


@pytest.mark.slow
@pytest.mark.tool  # (Triton's compiler)
def test_kernels_compile_for_gpu():
    result = _compile_ahead_of_time(_GPU_COMPILE_SCRIPT, timeout=600)
    assert result.returncode == 0 and "compiled 288" in result.stdout, result.stderr[-3000:]


def _compile_ahead_of_time(script: str, timeout: int) -> subprocess.CompletedProcess:
    """Run `script` (which compiles kernels for a GPU target) in a fresh interpreter without
    TRITON_INTERPRET; skip where triton has no NVIDIA backend."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=root,
                          capture_output=True, text=True, timeout=timeout)


# The sum over slots reaches slot r at wire + r * stride. Triton passes a stride below 2**31 as
# i32, and the slots of a large gather group span more: for world 3 and a stride of 2**30 bytes,
# slot 2 starts at 2**31. The product must be formed in 64 bits. Read off the compiled IR (TTIR),
# ahead of time like the compile test above: a run would need gigabytes of wire.
_STRIDE_IR_SCRIPT = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fsdp_ext.ops import triton_quant as tq

signature = {"wire_ptr": "*u8", "out_ptr": "*i32", "starts_ptr": "*i64", "nblocks": "i32",
             "n": "i32", "scales_at": "i32", "world": "i32", "stride": "i32"}
for fp8 in (False, True):
    constexprs = {"OUT_KIND": 0, "FP8": fp8, "SUM": True, "BLOCK": tq.BLOCK}
    kernel = triton.compile(
        ASTSource(fn=tq._dequantize_kernel, constexprs=constexprs,
                  signature={**signature, **{name: "constexpr" for name in constexprs}}),
        target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    ttir = kernel.asm["ttir"]
    offsets = re.findall(r"tt\.addptr %wire_ptr, %\S+ : !tt\.ptr<i8>, (i\d+)", ttir)
    assert offsets and set(offsets) == {"i64"}, (fp8, offsets)
print("slot offsets 64-bit")
"""


def test_dequantize_sum_slot_offsets_are_64_bit():
    result = _compile_ahead_of_time(_STRIDE_IR_SCRIPT, timeout=300)
    assert result.returncode == 0 and "slot offsets 64-bit" in result.stdout, \
        result.stderr[-3000:]
