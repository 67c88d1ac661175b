"""Materialise a unit's meta-device modules on the target device, one unit at a time.

A model built under `torch.device("meta")` has shapes but no storage. Each `fully_shard` call
allocates only the modules its unit owns, initialises them (`param_init_fn(module)`, else the
module's own `reset_parameters()`), and the unit then copies its shard out and drops the rest, so no
rank ever holds more than one unit unsharded. Every rank must draw the same values: seed the RNG
identically on all ranks (as for any replicated init).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .bucket import set_module_param


def _has_meta_state(module: nn.Module) -> bool:
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return any(t.is_meta for t in tensors)


def materialize_meta_modules(modules: list[nn.Module], device: torch.device,
                             param_init_fn: Callable[[nn.Module], None] | None) -> bool:
    """Allocate and initialise `modules` (those owned by one unit) that hold meta tensors.

    Tied parameters stay tied: `to_empty` gives each module a new Parameter, so the sharing is
    recorded first and restored before any initialisation runs. Returns whether anything changed.
    """
    meta_modules = [m for m in modules if _has_meta_state(m)]
    if not meta_modules:
        return False
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in modules:
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    for module in meta_modules:
        module.to_empty(device=device, recurse=False)
    for locations in holders.values():
        first_module, first_name = locations[0]
        shared = first_module._parameters[first_name]
        for module, name in locations[1:]:
            set_module_param(module, name, shared)
    with torch.no_grad():
        for module in meta_modules:
            if param_init_fn is not None:
                param_init_fn(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return True
