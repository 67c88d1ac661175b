"""Plain-torch definitions of the project's ops: the specification every backend is tested against.

The ops move data between many tensors and one flat 1-D buffer. A flat buffer represents a *window*
of a larger flat index space (a bucket's padded flat layout): `out_offset`/`src_offset` say where the
window starts, so a rank can pack straight into its own shard without materialising the whole bucket.

Arithmetic rules, shared by every backend so that results are bit-identical:
  * values are converted to fp32, scaled in fp32 (`x * scale`, skipped when scale == 1), and rounded
    to the destination dtype with round-to-nearest-even;
  * the epilogue adds in fp32 (`out + x * scale`, two roundings, no fused multiply-add).
"""
from __future__ import annotations

from typing import Sequence

import torch


def pack(srcs: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
         out_offset: int = 0, scale: float = 1.0) -> None:
    """Write every element of `out` (flat window [out_offset, out_offset + out.numel())).

    Source i occupies flat range [offsets[i], offsets[i] + srcs[i].numel()); the part of it inside the
    window is written as `cast(src * scale)`. Elements of the window that no source covers are zeroed.
    """
    out.zero_()
    lo, hi = out_offset, out_offset + out.numel()
    for src, off in zip(srcs, offsets):
        flat = src.reshape(-1)
        start, end = max(off, lo), min(off + flat.numel(), hi)
        if start >= end:
            continue
        piece = flat[start - off:end - off].float()
        if scale != 1.0:
            piece = piece * scale
        out[start - lo:end - lo].copy_(piece.to(out.dtype))


def unpack(src: torch.Tensor, src_offset: int, offsets: Sequence[int],
           outs: Sequence[torch.Tensor]) -> None:
    """Copy (with cast) the flat window held by `src` into the parts of `outs` that it covers.

    outs[i] occupies flat range [offsets[i], offsets[i] + outs[i].numel()); elements of outs[i]
    outside the window are left untouched.
    """
    lo, hi = src_offset, src_offset + src.numel()
    for dst, off in zip(outs, offsets):
        flat = dst.view(-1)
        start, end = max(off, lo), min(off + flat.numel(), hi)
        if start >= end:
            continue
        flat[start - off:end - off].copy_(src[start - lo:end - lo].to(dst.dtype))


def cast_into_slot(shard: torch.Tensor, gathered: torch.Tensor, slot: int) -> None:
    """gathered[slot*n : (slot+1)*n] = cast(shard), n = shard.numel() (the all-gather copy-in)."""
    n = shard.numel()
    gathered[slot * n:(slot + 1) * n].copy_(shard.reshape(-1).to(gathered.dtype))


def grad_epilogue(reduced: torch.Tensor, out: torch.Tensor, scale: float, accumulate: bool) -> None:
    """out = cast((out if accumulate else 0) + reduced * scale), computed in fp32."""
    value = reduced.reshape(-1).float()
    if scale != 1.0:
        value = value * scale
    if accumulate:
        value = out.reshape(-1).float() + value
    out.view(-1).copy_(value.to(out.dtype))


# ---- block-quantized collectives (CommPolicy) ---------------------------------------------------
# A rank's slot of a quantized collective holds n values as codes and per-block scales:
#     bytes [0, n)                       codes: int8, or float8_e4m3fn, one per value
#     bytes [align16(n), + 4 * nblocks)  scales: fp32, one per block of `block` values
# slot_bytes(n, block) = align16(align16(n) + 4 * nblocks), nblocks = ceil(n / block).
# Quantizing a block: x = fp32(value); amax = max |x| (NaN if any x is NaN); scale = amax / QMAX
# (QMAX 127 for int8, 448 for fp8); code = 0 where scale is 0, else int8: clamp(rint(x / scale),
# -127, 127) (rint: round half to even), fp8: cast(x / scale) (round to nearest even). A block with
# a NaN or an infinity gets scale NaN: it dequantizes to NaN, never to a finite value.
# Dequantizing: fp32(code) * scale, rounded to the output dtype; a sum over slots adds the
# dequantized fp32 values in slot order (each product rounded, then each sum: no fused multiply-add).
QUANT_FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def slot_bytes(n: int, block: int) -> int:
    """Bytes of one rank's slot holding `n` quantized values (see above)."""
    return _align16(_align16(n) + 4 * ((n + block - 1) // block))


def _slot_views(wire: torch.Tensor, slot: int, n: int, block: int, fmt: str):
    """(codes [n], scales [nblocks]) views of slot `slot` of the byte buffer `wire`."""
    base = slot * slot_bytes(n, block)
    codes = wire[base:base + n].view(QUANT_FORMATS[fmt][0])
    nblocks = (n + block - 1) // block
    start = base + _align16(n)
    scales = wire[start:start + 4 * nblocks].view(torch.float32)
    return codes, scales


def quantize_into_slot(src: torch.Tensor, wire: torch.Tensor, slot: int, block: int,
                       fmt: str) -> None:
    """Quantize the n values of `src` into slot `slot` of `wire` (uint8, at least (slot + 1) *
    slot_bytes(n, block) bytes)."""
    n = src.numel()
    codes, scales = _slot_views(wire, slot, n, block, fmt)
    if n == 0:
        return
    dtype, qmax = QUANT_FORMATS[fmt]
    nblocks = scales.numel()
    x = torch.zeros(nblocks * block, dtype=torch.float32, device=src.device)
    x[:n] = src.reshape(-1).float()
    x = x.view(nblocks, block)
    amax = x.abs().amax(dim=1)
    amax = torch.where(x.isnan().any(dim=1), torch.full_like(amax, float("nan")), amax)
    scale = torch.where(torch.isfinite(amax), amax / qmax, torch.full_like(amax, float("nan")))
    safe = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
    q = x / safe[:, None]
    if fmt == "int8":
        q = torch.round(q).clamp_(-127, 127)
    q = torch.where(((scale > 0) & torch.isfinite(scale))[:, None], q, torch.zeros_like(q))
    codes.copy_(q.reshape(-1)[:n].to(dtype))
    scales.copy_(scale)


def _dequantized(wire: torch.Tensor, slot: int, n: int, block: int, fmt: str) -> torch.Tensor:
    codes, scales = _slot_views(wire, slot, n, block, fmt)
    nblocks = scales.numel()
    x = torch.zeros(nblocks * block, dtype=torch.float32, device=wire.device)
    x[:n] = codes.float()
    return (x.view(nblocks, block) * scales[:, None]).reshape(-1)[:n]


def dequantize_slots(wire: torch.Tensor, out: torch.Tensor, world: int, block: int,
                     fmt: str) -> None:
    """out[r * n:(r + 1) * n] = dequantized slot r of `wire`, r < world, n = out.numel() / world
    (an all-gather's output)."""
    n = out.numel() // world
    for r in range(world):
        out[r * n:(r + 1) * n].copy_(_dequantized(wire, r, n, block, fmt).to(out.dtype))


def dequantize_sum(wire: torch.Tensor, out: torch.Tensor, world: int, block: int,
                   fmt: str) -> None:
    """out = the sum over r < world of dequantized slot r of `wire` (n = out.numel() values
    each), added in fp32 in slot order (an all-to-all's output: a reduce-scatter's sum)."""
    n = out.numel()
    total = torch.zeros(n, dtype=torch.float32, device=out.device)
    for r in range(world):
        total = total + _dequantized(wire, r, n, block, fmt)
    out.copy_(total.to(out.dtype))
