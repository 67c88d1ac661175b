"""Where a module's unit is kept: one attribute in the module's `__dict__`.

The unit, the schedule and every layer above find units through these two functions, so none of
them has to import the other to walk a model.
"""
from __future__ import annotations

import weakref

from torch import nn

UNIT_ATTR = "_fsdp_ext_unit"

# The nn.Parameters that fully_shard replaced with DTensor parameters, by id -> (weak reference,
# (module class, attribute, name in its unit), None or weak references to (its unit, its slot)).
# Weak: an original lives on only while something else (an optimizer built before fully_shard)
# holds it, which diagnostics/optim_check.py looks for at a step. Keyed by id, not by tensor: a
# WeakKeyDictionary compares keys with the tensors' elementwise ==.
_replaced: dict[int, tuple[weakref.ref, tuple[str, str, str], tuple | None]] = {}


def record_replaced(param, where: tuple[str, str, str]) -> None:
    """Remember that fully_shard replaced `param` (until `param` is freed)."""
    key = id(param)
    _replaced[key] = (weakref.ref(param, lambda _ref: _replaced.pop(key, None)), where, None)


def name_replaced_from(unit) -> None:
    """The parameters `unit` replaced are named by it from now on (Unit.param_name): by their
    name in the model once the root has named the units ('0.weight'), not only in the unit's
    module ('weight'), which is all that is known where they are replaced."""
    for bucket in unit.buckets:
        for slot in bucket.slots:
            original = slot.replaced()
            entry = _replaced.get(id(original)) if original is not None else None
            if entry is not None and entry[0]() is original:
                _replaced[id(original)] = (*entry[:2], (weakref.ref(unit), weakref.ref(slot)))


def replaced_where(param) -> tuple[str, str, str] | None:
    """(module class, attribute, name) of a parameter fully_shard replaced, else None."""
    entry = _replaced.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    owner, attr, name = entry[1]
    unit, slot = (ref() for ref in entry[2]) if entry[2] is not None else (None, None)
    return owner, attr, (unit.param_name(slot) if unit is not None and slot is not None
                         else name)


def unit_of(module: nn.Module):
    """The `Unit` that `fully_shard` made of `module`, or None."""
    return module.__dict__.get(UNIT_ATTR)


def units_with_paths(model: nn.Module) -> dict:
    """Every unit in `model`'s module tree (module order) -> the path in `model` of each of its
    modules (a list unit's in the list's order)."""
    paths: dict = {}
    for name, module in model.named_modules():
        if (unit := unit_of(module)) is not None:
            member = next(i for i, other in enumerate(unit.members) if other is module)
            paths.setdefault(unit, [""] * len(unit.members))[member] = name
    return paths


def unit_name(paths: list[str]) -> str:
    """A unit's name from its modules' paths: the path, or '[a, b]' for a list of modules."""
    return paths[0] if len(paths) == 1 else "[" + ", ".join(paths) + "]"


def units_of(model: nn.Module) -> list:
    """Every unit in `model`'s module tree, in module order (the root's first); a unit of a list
    of modules once, where its first member in that order is."""
    return list(dict.fromkeys(u for m in model.modules() if (u := unit_of(m)) is not None))
