"""Checks of a state dict against a sharded model before anything is loaded.

nn.Module.load_state_dict copies every entry it can and raises at the end, so a dict with one
wrong shape leaves the model half old, half new. A sharded module checks keys and global shapes
first (no collective: shapes are known locally) and raises before it writes anything.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from ..runtime.core.registry import units_of
from .names import unwrapped_name


def expected_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """Every state-dict key of `module` and the global shape of its value."""
    shapes = {}
    original = {id(slot.param): slot.placement.global_shape(slot.shape)
                for unit in units_of(module) for bucket in unit.buckets for slot in bucket.slots}
    for name, param in module.named_parameters(remove_duplicate=False):
        shapes[unwrapped_name(name)] = original.get(id(param), param.shape)
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                key = f"{prefix}.{name}" if prefix else name
                shapes[unwrapped_name(key)] = buffer.shape
    return shapes


def _shape_of(value) -> torch.Size | None:
    if isinstance(value, ShardedTensor):
        return torch.Size(value.metadata().size)
    return value.shape if isinstance(value, torch.Tensor) else None


def load_problems(module: nn.Module, state_dict: dict, strict: bool) -> list[str]:
    """What nn.Module.load_state_dict would complain about (strict keys, shapes), as its lines."""
    expected = expected_shapes(module)
    problems = []
    if strict:
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if unexpected:
            problems.append("Unexpected key(s) in state_dict: "
                            + ", ".join(f'"{k}"' for k in unexpected) + ". ")
        if missing:
            problems.append("Missing key(s) in state_dict: "
                            + ", ".join(f'"{k}"' for k in missing) + ". ")
    for key, shape in expected.items():
        got = _shape_of(state_dict.get(key))
        flattened = isinstance(state_dict.get(key), ShardedTensor) and list(got) == [shape.numel()]
        if got is not None and got != shape and not flattened:
            problems.append(f"size mismatch for {key}: copying a param with shape {got} from "
                            f"checkpoint, the shape in current model is {shape}.")
    return problems
