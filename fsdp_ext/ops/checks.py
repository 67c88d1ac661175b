"""Argument checks shared by the Python backends (reference and Triton).

The C++ and CUDA kernels run the same checks in `csrc/checks.h`; both name the offending argument so
that a bad call fails loudly instead of writing out of bounds.
"""
from __future__ import annotations

from typing import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_tensor(t: torch.Tensor, name: str, device: torch.device) -> None:
    _check(t.dtype in FLOAT_DTYPES, f"{name}: dtype {t.dtype} is not one of fp32/bf16/fp16")
    _check(t.device == device, f"{name}: on {t.device}, expected {device}")
    _check(t.is_contiguous(), f"{name}: must be contiguous")


def _check_disjoint(ranges: list[tuple[int, int, int]], what: str) -> None:
    """ranges: (start, end, index) in flat space; empty ranges never overlap."""
    prev_end, prev_i = None, None
    for start, end, i in sorted(r for r in ranges if r[1] > r[0]):
        _check(prev_end is None or start >= prev_end,
               f"{what}[{i}] overlaps {what}[{prev_i}] in the flat buffer")
        prev_end, prev_i = end, i


def check_pack(srcs: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
               out_offset: int) -> None:
    _check_tensor(out, "out", out.device)
    _check(out.dim() == 1, "out: must be 1-D")
    _check(len(srcs) == len(offsets), f"srcs has {len(srcs)} tensors but offsets has {len(offsets)}")
    _check(out_offset >= 0, "out_offset: must be >= 0")
    for i, (src, off) in enumerate(zip(srcs, offsets)):
        _check_tensor(src, f"srcs[{i}]", out.device)
        _check(off >= 0, f"offsets[{i}]: must be >= 0")
    _check_disjoint([(o, o + s.numel(), i) for i, (s, o) in enumerate(zip(srcs, offsets))], "srcs")


def check_unpack(src: torch.Tensor, src_offset: int, offsets: Sequence[int],
                 outs: Sequence[torch.Tensor]) -> None:
    _check_tensor(src, "src", src.device)
    _check(src.dim() == 1, "src: must be 1-D")
    _check(len(outs) == len(offsets), f"outs has {len(outs)} tensors but offsets has {len(offsets)}")
    _check(src_offset >= 0, "src_offset: must be >= 0")
    for i, (dst, off) in enumerate(zip(outs, offsets)):
        _check_tensor(dst, f"outs[{i}]", src.device)
        _check(off >= 0, f"offsets[{i}]: must be >= 0")
    _check_disjoint([(o, o + d.numel(), i) for i, (d, o) in enumerate(zip(outs, offsets))], "outs")


def check_cast_into_slot(shard: torch.Tensor, gathered: torch.Tensor, slot: int) -> None:
    _check_tensor(shard, "shard", gathered.device)
    _check_tensor(gathered, "gathered", gathered.device)
    # The reference slices gathered[slot*n:(slot+1)*n] along dim 0, a flat slot only in 1-D.
    _check(gathered.dim() == 1, "gathered: must be 1-D")
    _check(slot >= 0, "slot: must be >= 0")
    _check((slot + 1) * shard.numel() <= gathered.numel(),
           f"gathered: {gathered.numel()} elements cannot hold slot {slot} of {shard.numel()}")


def check_grad_epilogue(reduced: torch.Tensor, out: torch.Tensor) -> None:
    _check_tensor(reduced, "reduced", out.device)
    _check_tensor(out, "out", out.device)
    _check(reduced.numel() == out.numel(),
           f"reduced has {reduced.numel()} elements but out has {out.numel()}")


def check_quantized(n: int, wire: torch.Tensor, starts: torch.Tensor, fmt: str,
                    dtype: torch.dtype, slots: int, stride: int) -> None:
    """A quantized collective's bytes hold `slots` slots of n values in the blocks `starts`,
    `stride` bytes apart (one slot: stride unused) (reference.py)."""
    from .reference import QUANT_FORMATS, slot_bytes
    _check(fmt in QUANT_FORMATS, f"fmt: {fmt!r} is not one of {tuple(QUANT_FORMATS)}")
    _check(dtype in FLOAT_DTYPES, f"values: dtype {dtype} is not one of fp32/bf16/fp16")
    _check(starts.dtype == torch.int64 and starts.dim() == 1 and starts.device == wire.device,
           "starts: must be a 1-D int64 tensor on the wire's device")
    _check(n == 0 or (starts.numel() > 0), "starts: needs at least one block for n > 0 values")
    _check(wire.dtype == torch.uint8 and wire.dim() == 1 and wire.is_contiguous(),
           "wire: must be a contiguous 1-D uint8 tensor")
    need = slot_bytes(n, starts.numel())
    _check(slots == 1 or stride >= need, f"stride: {stride} bytes, a slot needs {need}")
    total = need if slots == 1 else (slots - 1) * stride + need
    _check(wire.numel() >= total, f"wire: {wire.numel()} bytes, {slots} slot(s) of {n} values "
                                  f"need {total}")
