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
