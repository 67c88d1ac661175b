"""Plain-torch definitions of the project's ops: the specification every backend is tested against.

The ops move data between many tensors and one flat 1-D buffer. A flat buffer represents a *window*
of a larger flat index space (a bucket's padded flat layout): `out_offset`/`src_offset` say where the
window starts, so a rank can pack straight into its own shard without materialising the whole bucket.

Arithmetic rules, shared by every backend so that results are bit-identical:
  * values are converted to fp32, scaled in fp32 (`x * scale`, skipped when scale == 1), and rounded
    to the destination dtype with round-to-nearest-even;
  * the epilogue divides as torch's FSDP2 does: `x / divisor` in fp32 (divisor rounded to fp32;
    skipped when it is 1), the quotient rounded to the reduced gradient's dtype, then added in fp32
    (`out + q`, no fused operation). A multiply by 1 / divisor would round differently unless the
    divisor is a power of two (at world 3, up to 1.5e-8 apart on unit-scale gradients).
"""
from __future__ import annotations

from typing import Sequence

import torch


def _window_parts(numels: Sequence[int], offsets: Sequence[int], lo: int, hi: int):
    """(i, slice of tensor i, slice of the window) for every tensor i (numels[i] elements at flat
    offsets[i]) that meets the window [lo, hi) of flat space: the part they share."""
    for i, (numel, off) in enumerate(zip(numels, offsets)):
        start, end = max(off, lo), min(off + numel, hi)
        if start < end:
            yield i, slice(start - off, end - off), slice(start - lo, end - lo)


def pack(srcs: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
         out_offset: int = 0, scale: float = 1.0) -> None:
    """Write every element of `out` (flat window [out_offset, out_offset + out.numel())).

    Source i occupies flat range [offsets[i], offsets[i] + srcs[i].numel()); the part of it inside the
    window is written as `cast(src * scale)`. Elements of the window that no source covers are zeroed.
    """
    out.zero_()
    window = (out_offset, out_offset + out.numel())
    for i, part, at in _window_parts([s.numel() for s in srcs], offsets, *window):
        piece = srcs[i].reshape(-1)[part].float()
        if scale != 1.0:
            piece = piece * scale
        out[at].copy_(piece.to(out.dtype))


def unpack(src: torch.Tensor, src_offset: int, offsets: Sequence[int],
           outs: Sequence[torch.Tensor]) -> None:
    """Copy (with cast) the flat window held by `src` into the parts of `outs` that it covers.

    outs[i] occupies flat range [offsets[i], offsets[i] + outs[i].numel()); elements of outs[i]
    outside the window are left untouched.
    """
    window = (src_offset, src_offset + src.numel())
    for i, part, at in _window_parts([d.numel() for d in outs], offsets, *window):
        outs[i].view(-1)[part].copy_(src[at].to(outs[i].dtype))


def cast_into_slot(shard: torch.Tensor, gathered: torch.Tensor, slot: int) -> None:
    """gathered[slot*n : (slot+1)*n] = cast(shard), n = shard.numel() (the all-gather copy-in)."""
    n = shard.numel()
    gathered[slot * n:(slot + 1) * n].copy_(shard.reshape(-1).to(gathered.dtype))


def grad_epilogue(reduced: torch.Tensor, out: torch.Tensor, divisor: float,
                  accumulate: bool) -> None:
    """out = cast((out if accumulate else 0) + q), computed in fp32, where q = reduced / divisor
    rounded to reduced's dtype: torch divides a reduced gradient in the reduce dtype (gloo's AVG,
    FSDP2's post-divide), then casts it to the gradient's dtype and accumulates."""
    value = reduced.reshape(-1).float()
    if divisor != 1.0:
        value = (value / torch.tensor(divisor, dtype=torch.float32)).to(reduced.dtype).float()
    if accumulate:
        value = out.reshape(-1).float() + value
    out.view(-1).copy_(value.to(out.dtype))


# ---- block-quantized collectives (CommPolicy) ---------------------------------------------------
# A slot of a quantized collective holds n values as codes and one scale per block:
#     bytes [0, n)                      codes: int8, or float8_e4m3fn, one per value
#     bytes [align16(n), + 4 * nblocks) scales: fp32, one per block
# Block b covers values [starts[b], starts[b + 1]) (the last one up to n): `starts` is sorted and
# begins at 0 (the runtime starts a block at every parameter and every `block_size` values within
# one, so no block mixes two parameters' magnitudes). slot_bytes(n, nblocks) =
# align16(align16(n) + 4 * nblocks); slots of a collective have one stride, at least that.
# Quantizing a block: x = fp32(value); amax = max |x|; scale = amax / QMAX (QMAX 127 for int8, 448
# for fp8); a block holding a NaN or an infinity gets scale NaN (it dequantizes to NaN, never to a
# finite value); code = 0 where the scale is 0 or NaN, else int8: clamp(rint(x / scale), -127,
# 127) (rint: round half to even), fp8: cast(x / scale) (round to nearest even, saturating at
# +-448 as torch's cast does). |x / scale| exceeds QMAX only where the scale is subnormal (amax
# below QMAX * 2^-126): amax / QMAX then keeps few significant bits, and the quotient reaches
# 1.5 QMAX (amax = 671 * 2^-149 gives scale 2^-149): int8 clamps it, fp8 saturates, so both
# dequantize to QMAX * scale there, a tiny value, never a NaN.
# Dequantizing: fp32(code) * scale, rounded to the output dtype; a sum over slots adds the
# dequantized fp32 values in slot order (each product rounded, then each sum: no fused multiply-add).
# At the top of the range the product can round past FLT_MAX: an int8 block whose amax is (near)
# FLT_MAX dequantizes its largest values to +-inf (RN(127 * RN(FLT_MAX / 127)) overflows), in
# every backend alike; fp8's 448 * RN(FLT_MAX / 448) rounds back to FLT_MAX.
QUANT_FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def slot_bytes(n: int, nblocks: int) -> int:
    """Bytes one slot of `n` values in `nblocks` blocks needs (see above)."""
    return _align16(_align16(n) + 4 * nblocks)


def _block_ids(starts: torch.Tensor, n: int) -> torch.Tensor:
    """The block of every value: [n] int64."""
    lengths = torch.diff(starts.cpu(), append=torch.tensor([n]))
    return torch.repeat_interleave(torch.arange(starts.numel()), lengths).to(starts.device)


def _views(slot: torch.Tensor, n: int, nblocks: int, fmt: str):
    codes = slot[:n].view(QUANT_FORMATS[fmt][0])
    scales = slot[_align16(n):_align16(n) + 4 * nblocks].view(torch.float32)
    return codes, scales


def quantize_into(src: torch.Tensor, slot: torch.Tensor, starts: torch.Tensor, fmt: str) -> None:
    """Quantize the n values of `src` into the bytes `slot` (at least slot_bytes(n, nblocks))."""
    n, nblocks = src.numel(), starts.numel()
    codes, scales = _views(slot, n, nblocks, fmt)
    if n == 0:
        return
    dtype, qmax = QUANT_FORMATS[fmt]
    x = src.reshape(-1).float()
    ids = _block_ids(starts, n)
    amax = torch.zeros(nblocks, device=x.device).scatter_reduce(
        0, ids, x.abs(), "amax", include_self=True)
    finite = torch.zeros(nblocks, dtype=torch.bool, device=x.device).scatter_reduce(
        0, ids, ~torch.isfinite(x), "amax", include_self=True).logical_not()
    scale = torch.where(finite, amax / qmax, torch.full_like(amax, float("nan")))
    usable = finite & (scale > 0)
    q = x / torch.where(usable, scale, torch.ones_like(scale))[ids]
    if fmt == "int8":
        q = torch.round(q).clamp_(-127, 127)
    q = torch.where(usable[ids], q, torch.zeros_like(q))
    codes.copy_(q.to(dtype))
    scales.copy_(scale)


def _dequantized(slot: torch.Tensor, n: int, starts: torch.Tensor, fmt: str) -> torch.Tensor:
    codes, scales = _views(slot, n, starts.numel(), fmt)
    return codes.float() * scales[_block_ids(starts, n)]


def dequantize_from(slot: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                    fmt: str) -> None:
    """out = the dequantized values of the bytes `slot` (n = out.numel())."""
    out.view(-1).copy_(_dequantized(slot, out.numel(), starts, fmt).to(out.dtype))


def dequantize_sum(wire: torch.Tensor, out: torch.Tensor, starts: torch.Tensor, world: int,
                   stride: int, fmt: str) -> None:
    """out = the sum over r < world of the dequantized slot at wire[r * stride:] (n =
    out.numel() values each, all in blocks `starts`), added in fp32 in slot order (an
    all-to-all's output: a reduce-scatter's sum)."""
    n = out.numel()
    total = torch.zeros(n, dtype=torch.float32, device=out.device)
    for r in range(world):
        total = total + _dequantized(wire[r * stride:(r + 1) * stride], n, starts, fmt)
    out.view(-1).copy_(total.to(out.dtype))
