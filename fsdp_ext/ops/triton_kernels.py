"""Triton kernels for pack, unpack, cast_into_slot and grad_epilogue (semantics: reference.py).

Every op is one launch, whatever the number of tensors, over the flat window in blocks of
BLOCK_SIZE elements.

Bits, not floats. Kernels read and write fp32 data as 32-bit integers and bf16/fp16 as 16-bit
integers, and round to bf16/fp16 (nearest even) with integer operations. That gives the same bits on
a GPU and in the CPU interpreter (TRITON_INTERPRET=1), whose own fp32->bf16 cast truncates.
Widening to fp32 is exact everywhere; `x * scale` is one fp32 multiply; the epilogue's `x /
divisor` is an IEEE division (`div_rn`) whose quotient is rounded to the reduced dtype on bits, and
the epilogue is launched with fp fusion off so that `out + q` rounds on its own, like the reference.

Many tensors, one launch. Triton cannot take a list of pointers, so pack and unpack pass a small
int64 *segment table* (the idea of the Triton grouped-GEMM tutorial and of ATen's `_chunk_cat`):
the window is cut into segments that tile it in order, each with its start in the window, the byte
address of its first element in the other tensor (`data_ptr()`), and a kind code for that tensor's
dtype; uncovered stretches are GAP segments. Kernels cast an address to a typed pointer
(`int64.to(tl.pointer_type(...))`). This works in the interpreter, where addresses are host
addresses, and on a GPU, where they are global-memory addresses. (Grouping sources by dtype would
not help: it still needs one pointer per tensor.) A block inside one segment uses scalar metadata;
a block that straddles segments finds each lane's segment by binary search in the table.

torch.compile: a kernel that dereferences a pointer table cannot be traced (the addresses come from
`data_ptr()`, and inductor could not see which tensors it reads or writes), so pack and unpack are
opaque `custom_op`s. cast_into_slot and grad_epilogue, whose tensors are all kernel arguments, are
traceable `triton_op`s.

Kernels use only builtins of triton.language (no @jit helpers from its standard library), so they
also run in the interpreter when triton was imported before TRITON_INTERPRET=1 was set.
"""
from __future__ import annotations

import array
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch.library import custom_op, triton_op, wrap_triton

from .triton_bits import _bf16_bits_from_f32, _f16_bits_from_f32

BLOCK_SIZE = 1024  # elements per program

# Dtype kind codes, shared by the host tables and the kernels.
KIND_F32: tl.constexpr = tl.constexpr(0)
KIND_BF16: tl.constexpr = tl.constexpr(1)
KIND_F16: tl.constexpr = tl.constexpr(2)
KIND_GAP: tl.constexpr = tl.constexpr(3)  # no tensor: pack writes zeros, unpack writes nothing
_KIND_OF = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BITS_DTYPE = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


# ---- conversions between raw bits and fp32 -------------------------------------------------------

@triton.jit
def _f32_from_bits16(bits, is_bf16):
    """Widen bf16 or fp16 bits (uint16) to fp32, exactly; `is_bf16` picks the format per lane."""
    from_bf16 = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    from_f16 = bits.to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where(is_bf16, from_bf16, from_f16)


@triton.jit
def _f32_from_raw(raw, KIND: tl.constexpr):
    """Widen int32/int16 bits of a tensor of kind KIND to fp32."""
    if KIND == KIND_F32:
        return raw.to(tl.float32, bitcast=True)
    else:
        return _f32_from_bits16(raw.to(tl.uint16, bitcast=True), KIND == KIND_BF16)


@triton.jit
def _rounded_to(x, KIND: tl.constexpr):
    """fp32 values rounded (nearest even, on bits) to KIND and widened back to fp32."""
    if KIND == KIND_F32:
        return x
    elif KIND == KIND_BF16:
        return _f32_from_bits16(_bf16_bits_from_f32(x), True)
    else:
        return _f32_from_bits16(_f16_bits_from_f32(x), False)


@triton.jit
def _load_f32(ptr, mask, KIND: tl.constexpr):
    """Load elements of a tensor passed as int32/int16 bits and widen them to fp32."""
    return _f32_from_raw(tl.load(ptr, mask=mask, other=0), KIND)


@triton.jit
def _store_f32(ptr, x, mask, KIND: tl.constexpr):
    """Round fp32 values to KIND and store them into a tensor passed as int32/int16 bits."""
    if KIND == KIND_F32:
        tl.store(ptr, x.to(tl.int32, bitcast=True), mask=mask)
    elif KIND == KIND_BF16:
        tl.store(ptr, _bf16_bits_from_f32(x).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, _f16_bits_from_f32(x).to(tl.int16, bitcast=True), mask=mask)


# ---- segment tables ------------------------------------------------------------------------------

@triton.jit
def _segment_at(starts_ptr, num_segments, position):
    """Scalar binary search: the last segment s with starts[s] <= position."""
    lo = tl.full([], 0, tl.int64)
    hi = (num_segments - 1).to(tl.int64)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        below = tl.load(starts_ptr + mid) <= position
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    return lo


@triton.jit
def _segments_at(starts_ptr, first, last, positions):
    """Per-lane binary search restricted to segments [first, last]; ceil(log2(span)) steps."""
    lo = tl.broadcast_to(first, positions.shape)
    hi = tl.broadcast_to(last, positions.shape)
    span = last - first
    while span > 0:
        mid = (lo + hi + 1) >> 1
        below = tl.load(starts_ptr + mid) <= positions
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
        span = span >> 1
    return lo


@triton.jit
def _pack_block(out_ptr, idx, mask, seg, table_ptr, table_stride, scale,
                OUT_KIND: tl.constexpr, APPLY_SCALE: tl.constexpr):
    """Pack the block's elements from segment(s) `seg` (one scalar, or one per lane)."""
    start = tl.load(table_ptr + seg)
    address = tl.load(table_ptr + table_stride + seg)
    kind = tl.load(table_ptr + 2 * table_stride + seg)
    elem = idx - start  # element index inside the source tensor
    is_f32 = kind == KIND_F32
    is_16 = (kind == KIND_BF16) | (kind == KIND_F16)
    # Masked loads: a lane reads only through the pointer type of its own source, never a GAP.
    w32 = tl.load(address.to(tl.pointer_type(tl.uint32)) + elem, mask=mask & is_f32, other=0)
    w16 = tl.load(address.to(tl.pointer_type(tl.uint16)) + elem, mask=mask & is_16, other=0)
    x = tl.where(is_f32, w32.to(tl.float32, bitcast=True), _f32_from_bits16(w16, kind == KIND_BF16))
    if APPLY_SCALE:
        x = x * scale
    x = tl.where(kind == KIND_GAP, 0.0, x)  # after scaling: 0 * -1 or 0 * inf must not leak
    _store_f32(out_ptr + idx, x, mask, OUT_KIND)


@triton.jit
def _pack_kernel(
    table_ptr,     # int64 [3, table_stride]: segment starts in the window (+ end sentinel),
                   #   source byte addresses, source kinds
    table_stride,  # number of segments + 1
    out_ptr,       # [n] output window, as int32 (fp32) or int16 (bf16/fp16) bits
    n,             # elements in the window
    scale,         # fp32 factor for every source element (used when APPLY_SCALE)
    OUT_KIND: tl.constexpr,     # kind code of out
    APPLY_SCALE: tl.constexpr,  # scale != 1
    BLOCK: tl.constexpr,        # elements per program
):
    block_start = tl.program_id(0).to(tl.int64) * BLOCK
    idx = block_start + tl.arange(0, BLOCK)
    mask = idx < n
    first = _segment_at(table_ptr, table_stride - 1, block_start)
    last = _segment_at(table_ptr, table_stride - 1, tl.minimum(block_start + BLOCK, n) - 1)
    if first == last:
        # Block inside one tensor (the bulk of large units): scalar metadata, contiguous loads.
        _pack_block(out_ptr, idx, mask, first, table_ptr, table_stride, scale, OUT_KIND,
                    APPLY_SCALE)
    else:
        seg = _segments_at(table_ptr, first, last, idx)
        _pack_block(out_ptr, idx, mask, seg, table_ptr, table_stride, scale, OUT_KIND,
                    APPLY_SCALE)


@triton.jit
def _unpack_block(x, raw, idx, mask, seg, table_ptr, table_stride, SRC_KIND: tl.constexpr):
    """Store the block's fp32 values `x` (raw source bits `raw`) into segment(s) `seg`."""
    start = tl.load(table_ptr + seg)
    address = tl.load(table_ptr + table_stride + seg)
    kind = tl.load(table_ptr + 2 * table_stride + seg)
    elem = idx - start  # element index inside the destination tensor
    is_16 = (kind == KIND_BF16) | (kind == KIND_F16)
    bits16 = tl.where(kind == KIND_BF16, _bf16_bits_from_f32(x), _f16_bits_from_f32(x))
    if SRC_KIND != KIND_F32:  # a destination of the source's dtype gets an exact copy
        bits16 = tl.where(kind == SRC_KIND, raw.to(tl.uint16, bitcast=True), bits16)
    tl.store(address.to(tl.pointer_type(tl.uint32)) + elem, x.to(tl.uint32, bitcast=True),
             mask=mask & (kind == KIND_F32))
    tl.store(address.to(tl.pointer_type(tl.uint16)) + elem, bits16, mask=mask & is_16)


@triton.jit
def _unpack_kernel(
    src_ptr,       # [n] source window, as int32 (fp32) or int16 (bf16/fp16) bits
    table_ptr,     # int64 [3, table_stride]: segment starts in the window (+ end sentinel),
                   #   destination byte addresses, destination kinds
    table_stride,  # number of segments + 1
    n,             # elements in the window
    SRC_KIND: tl.constexpr,  # kind code of src
    BLOCK: tl.constexpr,     # elements per program
):
    block_start = tl.program_id(0).to(tl.int64) * BLOCK
    idx = block_start + tl.arange(0, BLOCK)
    mask = idx < n
    raw = tl.load(src_ptr + idx, mask=mask, other=0)
    x = _f32_from_raw(raw, SRC_KIND)
    first = _segment_at(table_ptr, table_stride - 1, block_start)
    last = _segment_at(table_ptr, table_stride - 1, tl.minimum(block_start + BLOCK, n) - 1)
    if first == last:
        _unpack_block(x, raw, idx, mask, first, table_ptr, table_stride, SRC_KIND)
    else:
        seg = _segments_at(table_ptr, first, last, idx)
        _unpack_block(x, raw, idx, mask, seg, table_ptr, table_stride, SRC_KIND)


@triton.jit
def _cast_kernel(
    src_ptr,  # [n] input, as int32/int16 bits
    dst_ptr,  # [n] output, as int32/int16 bits
    n,        # elements
    SRC_KIND: tl.constexpr,  # kind code of src
    DST_KIND: tl.constexpr,  # kind code of dst
    BLOCK: tl.constexpr,     # elements per program
):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    if SRC_KIND == DST_KIND:
        tl.store(dst_ptr + idx, tl.load(src_ptr + idx, mask=mask), mask=mask)  # exact copy
    else:
        _store_f32(dst_ptr + idx, _load_f32(src_ptr + idx, mask, SRC_KIND), mask, DST_KIND)


@triton.jit
def _epilogue_kernel(
    reduced_ptr,  # [n] reduced gradient, as int32/int16 bits
    out_ptr,      # [n] gradient shard, as int32/int16 bits; read too when ACCUMULATE
    n,            # elements
    divisor,      # fp32 divisor of the reduced values (used when DIVIDE)
    IN_KIND: tl.constexpr,      # kind code of reduced
    OUT_KIND: tl.constexpr,     # kind code of out
    DIVIDE: tl.constexpr,       # divisor != 1
    ACCUMULATE: tl.constexpr,   # add to out instead of overwriting it
    BLOCK: tl.constexpr,        # elements per program
):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = _load_f32(reduced_ptr + idx, mask, IN_KIND)
    if DIVIDE:  # the quotient rounded to the reduced dtype, as torch divides in it
        x = _rounded_to(tl.math.div_rn(x, divisor), IN_KIND)
    if ACCUMULATE:
        x = _load_f32(out_ptr + idx, mask, OUT_KIND) + x  # launched without fp fusion: no fma
    _store_f32(out_ptr + idx, x, mask, OUT_KIND)


# ---- host side -----------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as integers of the same width, which is how the kernels see data."""
    return t.reshape(-1).view(_BITS_DTYPE[t.dtype])


def _fp32(value: float) -> float:
    """Round to fp32 on the host, so the kernel scales (or divides) by the reference's value."""
    return torch.tensor(value, dtype=torch.float32).item()


def _int64s(values: list[int]) -> torch.Tensor:
    """A list of ints as an int64 tensor; through `array`, much faster than torch.tensor(list)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def _segment_table(tensors: Sequence[torch.Tensor], offsets: Sequence[int], window_start: int,
                   window_len: int, device: torch.device) -> torch.Tensor:
    """int64 [3, S+1]: starts (window coordinates, then an end sentinel), byte addresses and kinds
    of the S segments that tile [0, window_len): the tensors clipped to the window, in flat order,
    and GAPs between them. Vectorised: per tensor, only its numel, address and dtype are read in
    Python (a Python loop doing the clipping costs milliseconds for 1000 tensors)."""
    numel = _int64s([t.numel() for t in tensors])
    address = _int64s([t.data_ptr() for t in tensors])
    kind = _int64s([_KIND_OF[t.dtype] for t in tensors])
    first = _int64s(list(offsets))
    start = first.clamp(min=window_start)
    end = (first + numel).clamp(max=window_start + window_len)
    inside = start < end
    itemsize = torch.where(kind == int(KIND_F32), 4, 2)
    address = (address + (start - first) * itemsize)[inside]
    start, end, kind = start[inside] - window_start, end[inside] - window_start, kind[inside]
    # Gaps: before each piece (after the previous one's end), and after the last piece.
    order = start.argsort()
    gap_start = torch.cat([start.new_zeros(1), end[order]])
    gap_end = torch.cat([start[order], start.new_full((1,), window_len)])
    gap_start = gap_start[gap_end > gap_start]
    starts = torch.cat([start, gap_start])
    order = starts.argsort()
    gap_fill = lambda value: gap_start.new_full(gap_start.shape, value)  # noqa: E731
    table = torch.stack([starts[order], torch.cat([address, gap_fill(0)])[order],
                         torch.cat([kind, gap_fill(int(KIND_GAP))])[order]])
    sentinel = torch.tensor([[window_len], [0], [int(KIND_GAP)]], dtype=torch.int64)
    table = torch.cat([table, sentinel], dim=1)
    # From pageable memory, a non_blocking copy is staged before it returns: the host table may go.
    return table.to(device, non_blocking=True)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK_SIZE),)


@custom_op("fsdp_ext::triton_pack", mutates_args=("out",))
def _pack_op(srcs: list[torch.Tensor], offsets: list[int], out: torch.Tensor, out_offset: int,
             scale: float) -> None:
    n = out.numel()
    if n == 0:
        return
    table = _segment_table(srcs, offsets, out_offset, n, out.device)
    _pack_kernel[_grid(n)](table, table.shape[1], _bits(out), n, _fp32(scale),
                           OUT_KIND=_KIND_OF[out.dtype], APPLY_SCALE=scale != 1.0, BLOCK=BLOCK_SIZE)


@_pack_op.register_fake
def _(srcs, offsets, out, out_offset, scale):
    return None


@custom_op("fsdp_ext::triton_unpack", mutates_args=("outs",))
def _unpack_op(src: torch.Tensor, src_offset: int, offsets: list[int],
               outs: list[torch.Tensor]) -> None:
    n = src.numel()
    if n == 0:
        return
    table = _segment_table(outs, offsets, src_offset, n, src.device)
    _unpack_kernel[_grid(n)](_bits(src), table, table.shape[1], n, SRC_KIND=_KIND_OF[src.dtype],
                             BLOCK=BLOCK_SIZE)


@_unpack_op.register_fake
def _(src, src_offset, offsets, outs):
    return None


@triton_op("fsdp_ext::triton_cast_into_slot", mutates_args=("gathered",))
def _cast_into_slot_op(shard: torch.Tensor, gathered: torch.Tensor, slot: int) -> None:
    n = shard.numel()
    if n == 0:
        return
    dst = gathered.view(-1).narrow(0, slot * n, n)
    wrap_triton(_cast_kernel)[_grid(n)](_bits(shard), _bits(dst), n, SRC_KIND=_KIND_OF[shard.dtype],
                                        DST_KIND=_KIND_OF[gathered.dtype], BLOCK=BLOCK_SIZE)


@triton_op("fsdp_ext::triton_grad_epilogue", mutates_args=("out",))
def _grad_epilogue_op(reduced: torch.Tensor, out: torch.Tensor, divisor: float,
                      accumulate: bool) -> None:
    n = out.numel()
    if n == 0:
        return
    # enable_fp_fusion=False: `out + q` must round on its own, like the reference.
    wrap_triton(_epilogue_kernel)[_grid(n)](
        _bits(reduced), _bits(out), n, _fp32(divisor), IN_KIND=_KIND_OF[reduced.dtype],
        OUT_KIND=_KIND_OF[out.dtype], DIVIDE=divisor != 1.0, ACCUMULATE=accumulate,
        BLOCK=BLOCK_SIZE, enable_fp_fusion=False)


# ---- entry points used by fsdp_ext.ops (arguments already checked) -------------------------------

def pack(srcs: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
         out_offset: int = 0, scale: float = 1.0) -> None:
    """See reference.pack. One launch over the output window."""
    torch.ops.fsdp_ext.triton_pack(list(srcs), [int(o) for o in offsets], out, int(out_offset),
                                   float(scale))


def unpack(src: torch.Tensor, src_offset: int, offsets: Sequence[int],
           outs: Sequence[torch.Tensor]) -> None:
    """See reference.unpack. One launch over the source window."""
    torch.ops.fsdp_ext.triton_unpack(src, int(src_offset), [int(o) for o in offsets], list(outs))


def cast_into_slot(shard: torch.Tensor, gathered: torch.Tensor, slot: int) -> None:
    """See reference.cast_into_slot."""
    torch.ops.fsdp_ext.triton_cast_into_slot(shard, gathered, int(slot))


def grad_epilogue(reduced: torch.Tensor, out: torch.Tensor, divisor: float,
                  accumulate: bool) -> None:
    """See reference.grad_epilogue."""
    torch.ops.fsdp_ext.triton_grad_epilogue(reduced, out, float(divisor), bool(accumulate))
