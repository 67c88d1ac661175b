"""Load a Hugging Face safetensors checkpoint straight into a sharded model: every rank reads only
the rows it holds.

    model = build_on_meta(); shard it; model.to_empty(device=...)      # each rank: its shards
    fsdp_ext.load_pretrained(model, "path/to/checkpoint")             # file, directory or index

torch's way for FSDP2 (`set_model_state_dict(..., broadcast_from_rank0=True)`) reads the whole
checkpoint on rank 0 and broadcasts every tensor, so rank 0 needs the full model in memory and the
start-up waits for one reader. Here each rank memory-maps the files (safetensors' `safe_open`) and
asks for the rows of each parameter that its shard holds (a rank's part of a parameter is one
contiguous range of its flattened elements, so a slice of whole rows covers it): no collective, no
full copy anywhere, dtype converted on the way. Buffers (and parameters fsdp_ext does not shard, such
as `ignored_params`) are read whole.

Keys follow `from_pretrained`: a tied weight needs only one of its names in the checkpoint;
`strict=True` raises listing missing and unexpected keys; a shape that differs raises naming the
tensor and both shapes. All of it is checked before anything is written, from the headers alone (the
same on every rank, so every rank raises alike). Tensor-parallel parameters are refused (use DCP).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..runtime.core.registry import units_of
from .load_checks import expected_shapes
from .names import unwrapped_name

_INDEX = "model.safetensors.index.json"


@dataclass
class LoadResult:
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> the file holding it, for a .safetensors file, a directory with one (or with
    model.safetensors.index.json, as sharded Hugging Face checkpoints have), or an index file."""
    from safetensors import safe_open
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, _INDEX)):
            path = os.path.join(path, _INDEX)
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"load_pretrained: no .safetensors file in {path}")
            names = {}
            for f in files:
                with safe_open(os.path.join(path, f), framework="pt") as handle:
                    names.update({k: os.path.join(path, f) for k in handle.keys()})
            return names
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        root = os.path.dirname(path)
        return {name: os.path.join(root, file) for name, file in weight_map.items()}
    with safe_open(path, framework="pt") as handle:
        return {name: path for name in handle.keys()}


class _Files:
    """The checkpoint's files, each opened (memory-mapped) once."""

    def __init__(self, where: dict[str, str]):
        from safetensors import safe_open
        self.where = where
        self.handles = {f: safe_open(f, framework="pt") for f in sorted(set(where.values()))}

    def shape(self, name: str) -> list[int]:
        return list(self.handles[self.where[name]].get_slice(name).get_shape())

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of tensor `name` (all of a 0-d tensor)."""
        tensor_slice = self.handles[self.where[name]].get_slice(name)
        if not tensor_slice.get_shape():
            return tensor_slice[:]
        return tensor_slice[start:end]

    def whole(self, name: str) -> torch.Tensor:
        return self.handles[self.where[name]].get_tensor(name)


def _flat_range(files: _Files, name: str, shape, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of the flattened tensor `name`, reading only the rows covering them."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    first, last = start // row, -(-end // row)
    return files.rows(name, first, last).reshape(-1)[start - first * row:end - first * row]


def _check(expected: dict[str, torch.Size], aliases: list[list[str]], files: _Files,
           strict: bool) -> LoadResult:
    have = files.where
    problems = []
    for name in sorted(set(have) & set(expected)):
        saved = files.shape(name)
        if list(expected[name]) != saved:
            problems.append(f"size mismatch for {name}: the checkpoint has shape {saved}, the "
                            f"model has {list(expected[name])}")
    aliased = {n for names in aliases for n in names}
    missing = [names[0] for names in aliases if not any(n in have for n in names)]
    missing += [n for n in expected if n not in aliased and n not in have]  # buffers
    unexpected = [n for n in have if n not in expected]
    if strict and missing:
        problems.append(f"missing keys (in the model, not in the checkpoint): {sorted(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected keys (in the checkpoint, not in the model): "
                        f"{sorted(unexpected)}")
    if problems:
        raise ValueError("load_pretrained: the checkpoint does not match the model:\n  "
                         + "\n  ".join(problems))
    return LoadResult(sorted(missing), sorted(unexpected))


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str, strict: bool = True) -> LoadResult:
    """Fill a sharded (and materialized) model from a safetensors checkpoint; see the module doc.
    Returns the missing and unexpected keys (empty with strict=True, which raises instead)."""
    module = getattr(model, "_fsdp_wrapped_module", model)
    units = units_of(module)
    for unit in units:
        for bucket in unit.buckets:
            for slot in bucket.slots:
                slot.placement.require_whole(lambda: NotImplementedError(
                    f"load_pretrained: parameter '{slot.fqn}' of unit '{unit.name or '<root>'}' "
                    "is tensor-parallel; load it with torch.distributed.checkpoint instead"))
                if slot.param.is_meta or bucket.shard.is_meta:
                    raise ValueError(
                        f"load_pretrained: parameter '{slot.fqn}' of unit '{unit.name or '<root>'}' "
                        "is on the meta device: call model.to_empty(device=...) first")
    expected = {unwrapped_name(k): v for k, v in expected_shapes(module).items()}
    names_of: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(unwrapped_name(name))
    files = _Files(checkpoint_files(path))
    result = _check(expected, list(names_of.values()), files, strict)

    def source(param) -> str | None:
        return next((n for n in names_of.get(id(param), []) if n in files.where), None)

    sharded = set()
    for unit in units:
        if unit.params.gathered():  # gathered copies would go stale: drop them first
            unit.reshard()
        if unit.schedule is not None:
            unit.schedule.host_reads.sync()  # offloaded shards may be read by a side stream
        for bucket in unit.buckets:
            for index, slot in enumerate(bucket.slots):
                sharded.add(id(slot.param))
                name = source(slot.param)
                if name is None or not bucket.shard_views[index].numel():
                    continue
                if bucket.layout.contiguous(index):  # only the rows covering this rank's range
                    values = _flat_range(files, name, slot.shape,
                                         *bucket.layout.param_range(index))
                else:  # sharded along a later dim: a block of every outer index
                    values = bucket.layout.local_part(index, files.whole(name)).reshape(-1)
                bucket.shard_views[index].view(-1).copy_(values)
    for param in module.parameters():  # not sharded by fsdp_ext (ignored_params)
        if id(param) not in sharded and (name := source(param)) is not None:
            param.copy_(files.whole(name))
    for prefix, sub in module.named_modules():
        for attr, buffer in sub._buffers.items():
            key = unwrapped_name(f"{prefix}.{attr}" if prefix else attr)
            if buffer is not None and key in files.where:
                buffer.copy_(files.whole(key))
    return result
