"""Fake (meta) implementations of the compiled ops, so they trace under torch.compile / FakeTensor.

The ops only write into their arguments and return nothing, so a fake implementation has nothing
to compute: it validates what is visible without data (the conditions of checks.py and
csrc/checks.h, raised as ValueError through torch._check_value) and returns None. register_fake also
serves the Meta key, so a call mixing a meta tensor with real ones lands here and fails by name.
ops.cpp names this module with set_python_module, so tracing without importing it says where to look.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .checks import FLOAT_DTYPES, _check_disjoint


def _check_tensor(t: torch.Tensor, name: str, device: torch.device) -> None:
    torch._check_value(t.dtype in FLOAT_DTYPES,
                       lambda: f"{name}: dtype {t.dtype} is not one of fp32/bf16/fp16")
    torch._check_value(t.device == device, lambda: f"{name}: on {t.device}, expected {device}")
    torch._check_value(t.is_contiguous(), lambda: f"{name}: must be contiguous")


def _check_list(tensors: Sequence[torch.Tensor], offsets: Sequence[int], what: str,
                device: torch.device) -> None:
    torch._check_value(len(tensors) == len(offsets),
                       lambda: f"{what} has {len(tensors)} tensors but offsets has {len(offsets)}")
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        _check_tensor(t, f"{what}[{i}]", device)
        torch._check_value(off >= 0, lambda: f"offsets[{i}]: must be >= 0")
    ranges = [(off, off + t.numel(), i) for i, (t, off) in enumerate(zip(tensors, offsets))]
    # Sorting symbolic sizes would specialize them; the kernel checks overlaps at run time anyway.
    if all(isinstance(x, int) for r in ranges for x in r[:2]):
        _check_disjoint(ranges, what)


@torch.library.register_fake("fsdp_ext::pack")
def _pack_fake(srcs, offsets, out, out_offset=0, scale=1.0) -> None:
    _check_tensor(out, "out", out.device)
    torch._check_value(out.dim() == 1, lambda: "out: must be 1-D")
    torch._check_value(out_offset >= 0, lambda: "out_offset: must be >= 0")
    _check_list(srcs, offsets, "srcs", out.device)


@torch.library.register_fake("fsdp_ext::unpack")
def _unpack_fake(src, src_offset, offsets, outs) -> None:
    _check_tensor(src, "src", src.device)
    torch._check_value(src.dim() == 1, lambda: "src: must be 1-D")
    torch._check_value(src_offset >= 0, lambda: "src_offset: must be >= 0")
    _check_list(outs, offsets, "outs", src.device)


@torch.library.register_fake("fsdp_ext::cast_into_slot")
def _cast_into_slot_fake(shard, gathered, slot) -> None:
    _check_tensor(shard, "shard", gathered.device)
    _check_tensor(gathered, "gathered", gathered.device)
    torch._check_value(gathered.dim() == 1, lambda: "gathered: must be 1-D")
    torch._check_value(slot >= 0, lambda: "slot: must be >= 0")
    torch._check_value((slot + 1) * shard.numel() <= gathered.numel(),
                       lambda: f"gathered: {gathered.numel()} elements cannot hold slot {slot} "
                               f"of {shard.numel()}")


@torch.library.register_fake("fsdp_ext::grad_epilogue")
def _grad_epilogue_fake(reduced, out, divisor, accumulate) -> None:
    _check_tensor(reduced, "reduced", out.device)
    _check_tensor(out, "out", out.device)
    torch._check_value(reduced.numel() == out.numel(),
                       lambda: f"reduced has {reduced.numel()} elements but out has {out.numel()}")


@torch.library.register_fake("fsdp_ext::quantize_into")
def _quantize_into_fake(src, slot, starts, fp8) -> None:
    _check_tensor(src, "src", slot.device)
    torch._check_value(slot.dtype == torch.uint8 and slot.dim() == 1,
                       lambda: "slot: must be a 1-D uint8 tensor")


@torch.library.register_fake("fsdp_ext::dequantize_from")
def _dequantize_from_fake(slot, out, starts, fp8) -> None:
    _check_tensor(out, "out", slot.device)
    torch._check_value(slot.dtype == torch.uint8 and slot.dim() == 1,
                       lambda: "slot: must be a 1-D uint8 tensor")


@torch.library.register_fake("fsdp_ext::dequantize_sum")
def _dequantize_sum_fake(wire, out, starts, world, stride, fp8) -> None:
    _check_tensor(out, "out", wire.device)
    torch._check_value(wire.dtype == torch.uint8 and wire.dim() == 1,
                       lambda: "wire: must be a 1-D uint8 tensor")
