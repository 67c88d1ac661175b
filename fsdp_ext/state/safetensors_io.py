"""Export a sharded model to one .safetensors file, each rank writing the bytes it owns.

The format (huggingface/safetensors, "format" in its README):

    [8 bytes: N, little-endian u64][N bytes: JSON header][data]

The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end)}, offsets
relative to the start of the data; "__metadata__" holds str -> str. Tensors must tile the data
exactly (no gaps, no overlaps). The header may be padded with spaces; we pad it to a multiple of 8
bytes and order tensors by decreasing element size, so every tensor starts aligned to its element
size (readers can map it without copying).

Nothing is gathered: the header depends only on shapes and dtypes, which every rank knows, so rank 0
writes it and sizes the file; then each rank writes its shard views' bytes at their file offsets
with pwrite (a parameter is row-major, and a rank's part of it is one contiguous range of the
flattened parameter, hence one contiguous byte range of the file). With replicas (HSDP, NO_SHARD)
only replica 0 writes. The file is written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .agree import all_ok, on_rank0
from .names import unwrapped_name
from .optim_state_dict import param_infos
from .sharded_tensor import local_param_range
from .state_dict import sharded_state_dict

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass
class Entry:
    name: str
    dtype: torch.dtype
    shape: list[int]
    info: object = None            # a sharded parameter's ParamInfo
    buffer: torch.Tensor | None = None
    begin: int = 0                 # data_offsets, set by layout()

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def collect_entries(model: nn.Module, save_tied_once: bool) -> tuple[list[Entry], dict[str, str]]:
    """The model's state-dict entries (unwrapped names), and tied aliases left out (alias -> name)."""
    infos = param_infos(model)
    by_name = {unwrapped_name(name): p
               for name, p in model.named_parameters(remove_duplicate=False)}
    entries, first_name, aliases = [], {}, {}
    for key, value in sharded_state_dict(model).items():  # no collective: keys and buffers only
        param = by_name.get(key)
        if param is not None:
            if save_tied_once and id(param) in first_name:
                aliases[key] = first_name[id(param)]
                continue
            first_name.setdefault(id(param), key)
            info = infos[id(param)]
            entries.append(Entry(key, info.bucket.dtype, list(info.slot.shape), info=info))
        elif isinstance(value, torch.Tensor):
            entries.append(Entry(key, value.dtype, list(value.shape), buffer=value))
        else:
            raise TypeError(f"state-dict entry '{key}' is a {type(value).__name__}; "
                            "safetensors holds tensors only")
    for e in entries:
        if e.dtype not in DTYPE_NAMES:
            raise TypeError(f"'{e.name}': dtype {e.dtype} has no safetensors name")
    return entries, aliases


def layout(entries: list[Entry], metadata: dict[str, str]) -> tuple[bytes, int]:
    """Assign data offsets; return (the 8-byte length + padded JSON header, total file size)."""
    order = sorted(entries, key=lambda e: -e.dtype.itemsize)  # stable: keeps state-dict order
    offset = 0
    header: dict = {"__metadata__": metadata} if metadata else {}
    for e in order:
        e.begin = offset
        offset += e.nbytes
        header[e.name] = {"dtype": DTYPE_NAMES[e.dtype], "shape": e.shape,
                          "data_offsets": [e.begin, offset]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = len(text).to_bytes(8, "little") + text
    return prefix, len(prefix) + offset


def _as_bytes(tensor: torch.Tensor):
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def _write_own_ranges(fd: int, entries: list[Entry], data_start: int, rank: int) -> None:
    """pwrite every byte range this rank is responsible for."""
    for e in entries:
        if e.buffer is not None:
            if rank == 0:  # buffers are replicated: rank 0 writes them
                os.pwrite(fd, _as_bytes(e.buffer), data_start + e.begin)
            continue
        groups = e.info.bucket.groups
        if groups.replicate is not None and dist.get_rank(groups.replicate) != 0:
            continue  # another replica holds the same bytes
        layout, index = e.info.bucket.layout, e.info.index
        local = e.info.bucket.shard_views[index]
        if not local.numel():
            continue
        if layout.contiguous(index):  # a rank's part of a row-major tensor is one range
            start, _ = local_param_range(e.info.bucket, index)
            os.pwrite(fd, _as_bytes(local), data_start + e.begin + start * e.dtype.itemsize)
            continue
        slot = layout.slots[index]  # Shard(d > 0): one range per index of the dims before d
        block = slot.shape[slot.dim] * slot.row_numel
        first = layout.rank * slot.chunk_rows * slot.row_numel
        for o, piece in enumerate(local.reshape(slot.outer, -1)):
            os.pwrite(fd, _as_bytes(piece),
                      data_start + e.begin + (o * block + first) * e.dtype.itemsize)


def export_safetensors(model: nn.Module, path, *, save_tied_once: bool = False,
                       metadata: dict[str, str] | None = None) -> None:
    """Write the full model to `path` (.safetensors) from the shards; every rank must call it.

    Keys, shapes and dtypes are those of the unwrapped model's state_dict(), so
    `model.load_state_dict(safetensors.torch.load_file(path))` works on an unwrapped model.
    Tied weights are written under every key (strict loading works); with `save_tied_once`, only
    under the first, and `__metadata__["fsdp_ext.tied"]` maps the others to it (load those with
    strict=False, as transformers does).
    """
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors data is little-endian; this host is not")
    path = os.fspath(path)
    tmp = path + ".tmp"
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    entries, aliases = collect_entries(model, save_tied_once)
    meta = dict(metadata or {})
    if aliases:
        meta["fsdp_ext.tied"] = json.dumps(aliases)
    prefix, total = layout(entries, meta)

    def create():
        with open(tmp, "wb") as f:
            f.write(prefix)
            f.truncate(total)  # pre-size: ranks write into holes
    on_rank0(create)
    error = None
    try:
        fd = os.open(tmp, os.O_WRONLY)
        try:
            _write_own_ranges(fd, entries, len(prefix), rank)
            os.fsync(fd)
        finally:
            os.close(fd)
    except Exception as exc:  # noqa: BLE001 - reported on every rank by all_ok
        error = exc
    all_ok(error)
    on_rank0(lambda: os.replace(tmp, path))
