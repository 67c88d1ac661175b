"""One entry point per kernel; each picks a backend.

Backends: "cpp" (C++ CPU kernels) and "cuda" (CUDA kernels), both reached through the dispatcher as
`torch.ops.fsdp_ext.*`; "triton" (Triton kernels; on CPU only under TRITON_INTERPRET=1); "torch" (the
plain-torch reference in `reference.py`). The default is the compiled kernel for the tensors' device,
and the reference when the extension is not built (with a one-time warning). FSDP_EXT_BACKEND in the
environment overrides the default.

Owns: the Python side of the kernels (this file), their plain-torch reference (reference.py, the
specification), argument checks (checks.py), fake implementations for torch.compile (fake.py) and
the Triton kernels (triton_kernels.py). The C++ / CUDA sources are in csrc/.

May import: nothing of fsdp_ext but the compiled `fsdp_ext._C`. Every layer above may import it.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

from .. import env
from . import checks, reference

try:
    from fsdp_ext import _C  # noqa: F401  (importing registers torch.ops.fsdp_ext.*)
    from . import fake  # noqa: F401  (fake implementations, for torch.compile)
    HAVE_EXTENSION = True
except ImportError:  # not built: fall back to the reference
    HAVE_EXTENSION = False

BACKENDS = ("cpp", "cuda", "triton", "torch")
_warned = False


def default_backend(device: torch.device) -> str:
    forced = env.process().backend
    if forced:
        return forced
    if HAVE_EXTENSION:
        return "cuda" if device.type == "cuda" else "cpp"
    global _warned
    if not _warned:
        warnings.warn("fsdp_ext._C is not built; using the plain-torch reference ops", stacklevel=3)
        _warned = True
    return "torch"


def _resolve(backend: str | None, device: torch.device) -> str:
    backend = backend or default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend in ("cpp", "cuda"):
        if not HAVE_EXTENSION:
            raise RuntimeError(f"backend {backend!r} needs the compiled extension fsdp_ext._C")
        want = "cuda" if device.type == "cuda" else "cpu"
        if (backend == "cuda") != (want == "cuda"):
            raise ValueError(f"backend {backend!r} cannot run on {device} tensors")
    return backend


def _triton():
    from . import triton_kernels  # imported lazily: TRITON_INTERPRET must be set before import
    return triton_kernels


def _triton_quant():
    from . import triton_quant  # lazily, as _triton()
    return triton_quant


def _as_list(items: Sequence) -> list | tuple:
    """Lists and tuples as they are (the dispatcher converts and type-checks each element, and
    rejects what is not an int or a tensor); any other iterable as a list."""
    return items if type(items) is list or type(items) is tuple else list(items)


def pack(srcs: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
         out_offset: int = 0, scale: float = 1.0, backend: str | None = None) -> None:
    """Pack `srcs` into the flat window `out` (see reference.pack)."""
    backend = _resolve(backend, out.device)
    if backend in ("cpp", "cuda"):
        # No per-element work here: with 1000 tensors a Python loop costs as much as the copy.
        torch.ops.fsdp_ext.pack.default(_as_list(srcs), _as_list(offsets), out, int(out_offset),
                                        float(scale))
        return
    srcs, offsets = list(srcs), [int(o) for o in offsets]
    checks.check_pack(srcs, offsets, out, out_offset)
    impl = _triton() if backend == "triton" else reference
    impl.pack(srcs, offsets, out, int(out_offset), float(scale))


def unpack(src: torch.Tensor, src_offset: int, offsets: Sequence[int],
           outs: Sequence[torch.Tensor], backend: str | None = None) -> None:
    """Copy the flat window `src` into the parts of `outs` it covers (see reference.unpack)."""
    backend = _resolve(backend, src.device)
    if backend in ("cpp", "cuda"):
        torch.ops.fsdp_ext.unpack.default(src, int(src_offset), _as_list(offsets), _as_list(outs))
        return
    outs, offsets = list(outs), [int(o) for o in offsets]
    checks.check_unpack(src, src_offset, offsets, outs)
    impl = _triton() if backend == "triton" else reference
    impl.unpack(src, int(src_offset), offsets, outs)


def cast_into_slot(shard: torch.Tensor, gathered: torch.Tensor, slot: int,
                   backend: str | None = None) -> None:
    """gathered[slot*n:(slot+1)*n] = cast(shard) (see reference.cast_into_slot)."""
    backend = _resolve(backend, gathered.device)
    if backend in ("cpp", "cuda"):
        torch.ops.fsdp_ext.cast_into_slot.default(shard, gathered, int(slot))
        return
    checks.check_cast_into_slot(shard, gathered, slot)
    impl = _triton() if backend == "triton" else reference
    impl.cast_into_slot(shard, gathered, int(slot))


def grad_epilogue(reduced: torch.Tensor, out: torch.Tensor, divisor: float = 1.0,
                  accumulate: bool = False, backend: str | None = None) -> None:
    """out = cast((out if accumulate else 0) + reduced / divisor) (see reference.grad_epilogue)."""
    backend = _resolve(backend, out.device)
    if backend in ("cpp", "cuda"):
        torch.ops.fsdp_ext.grad_epilogue.default(reduced, out, float(divisor), bool(accumulate))
        return
    checks.check_grad_epilogue(reduced, out)
    impl = _triton() if backend == "triton" else reference
    impl.grad_epilogue(reduced, out, float(divisor), bool(accumulate))


# ---- block-quantized collectives (CommPolicy; layout and arithmetic: reference.py) ---------------
slot_bytes = reference.slot_bytes


def quantize_into(src: torch.Tensor, slot: torch.Tensor, starts: torch.Tensor, fmt: str,
                  backend: str | None = None) -> None:
    """Quantize `src` into the bytes `slot`, one scale per block of `starts` (see
    reference.quantize_into)."""
    backend = _resolve(backend, slot.device)
    checks.check_quantized(src.numel(), slot, starts, fmt, src.dtype, 1, 0)
    if backend in ("cpp", "cuda"):
        torch.ops.fsdp_ext.quantize_into.default(src, slot, starts, fmt == "fp8")
        return
    (_triton_quant() if backend == "triton" else reference).quantize_into(src, slot, starts, fmt)


def dequantize_from(slot: torch.Tensor, out: torch.Tensor, starts: torch.Tensor, fmt: str,
                    backend: str | None = None) -> None:
    """out = the dequantized values of the bytes `slot` (see reference.dequantize_from)."""
    backend = _resolve(backend, slot.device)
    checks.check_quantized(out.numel(), slot, starts, fmt, out.dtype, 1, 0)
    if backend in ("cpp", "cuda"):
        torch.ops.fsdp_ext.dequantize_from.default(slot, out, starts, fmt == "fp8")
        return
    (_triton_quant() if backend == "triton" else reference).dequantize_from(slot, out, starts,
                                                                             fmt)


def dequantize_sum(wire: torch.Tensor, out: torch.Tensor, starts: torch.Tensor, world: int,
                   stride: int, fmt: str, backend: str | None = None) -> None:
    """out = the fp32 sum of the `world` dequantized slots of `wire`, `stride` bytes apart (see
    reference.dequantize_sum)."""
    backend = _resolve(backend, wire.device)
    checks.check_quantized(out.numel(), wire, starts, fmt, out.dtype, world, stride)
    if backend in ("cpp", "cuda"):
        torch.ops.fsdp_ext.dequantize_sum.default(wire, out, starts, int(world), int(stride),
                                                  fmt == "fp8")
        return
    (_triton_quant() if backend == "triton" else reference).dequantize_sum(
        wire, out, starts, int(world), int(stride), fmt)
