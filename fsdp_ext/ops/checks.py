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


def _check_window(flat: torch.Tensor, flat_name: str, flat_offset: int,
                  tensors: Sequence[torch.Tensor], tensors_name: str,
                  offsets: Sequence[int]) -> None:
    """A flat window (1-D, at flat_offset) and the tensors at `offsets` in flat space (pack's
    sources, unpack's outputs): same device, offsets >= 0, no two tensors overlapping."""
    _check_tensor(flat, flat_name, flat.device)
    _check(flat.dim() == 1, f"{flat_name}: must be 1-D")
    _check(len(tensors) == len(offsets),
           f"{tensors_name} has {len(tensors)} tensors but offsets has {len(offsets)}")
    _check(flat_offset >= 0, f"{flat_name}_offset: must be >= 0")
    for i, (tensor, off) in enumerate(zip(tensors, offsets)):
        _check_tensor(tensor, f"{tensors_name}[{i}]", flat.device)
        _check(off >= 0, f"offsets[{i}]: must be >= 0")
    _check_disjoint([(o, o + t.numel(), i) for i, (t, o) in enumerate(zip(tensors, offsets))],
                    tensors_name)


def check_pack(srcs: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
               out_offset: int) -> None:
    _check_window(out, "out", out_offset, srcs, "srcs", offsets)


def check_unpack(src: torch.Tensor, src_offset: int, offsets: Sequence[int],
                 outs: Sequence[torch.Tensor]) -> None:
    _check_window(src, "src", src_offset, outs, "outs", offsets)


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
