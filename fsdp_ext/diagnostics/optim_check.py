"""`check_optimizer(model, optimizer)`: catch an optimizer that cannot train a sharded model.

Sharding keeps the user's nn.Parameter objects (each becomes a 1-D view of its shard), so an
optimizer built before or after fully_shard over `model.parameters()` is right. Two mistakes are
silent otherwise: an optimizer over another model's parameters (the unwrapped reference, a copy made
before wrapping) steps tensors the sharded model never reads, and one that already stepped before
wrapping holds full-shape state (exp_avg, ...) that no longer lines up with the shards. The check
is explicit (call it once after building the optimizer): it reads only local metadata and issues no
collective, and an optimizer may legitimately cover only part of the model, which it allows.

The commonest of the two, an optimizer built from `model.parameters()` before `fully_shard`, is also
caught without the user's help: `install_step_check()` (called by fully_shard) registers one global
optimizer step pre-hook with torch, which at an optimizer's first step (and after it gains a
parameter group) looks its parameters up among those fully_shard replaced and raises, naming the
parameter and the fix. torch's FSDP2 is silent there and the model never trains. The look-up is a
dictionary probe per parameter, on the host, once per optimizer: no tensor is read. The hook runs
for every optimizer of the process, fully_shard's or not, so it keys what it remembers by the
optimizer's identity: an optimizer class may define `__eq__` (and so be unhashable) or a `__hash__`
of its own, neither of which the check may call.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..runtime.core.registry import replaced_where, units_of

# id(optimizer) -> (a weak reference to it, its number of param groups when checked). The weak
# reference's callback drops the entry when the optimizer goes, before its id can be reused.
_checked_groups: dict[int, tuple[weakref.ref, int]] = {}
_step_hook = None


def install_step_check() -> None:
    """Register the global step pre-hook once per process (idempotent)."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_check_at_step)


def _check_at_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Raise before an optimizer's first step if it holds a parameter fully_shard replaced."""
    key = id(optimizer)
    seen = _checked_groups.get(key)
    if seen is not None and seen[0]() is optimizer and seen[1] == len(optimizer.param_groups):
        return
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if (where := replaced_where(param)) is not None:
                owner, attr, fqn = where
                raise ValueError(
                    f"{type(optimizer).__name__}.step(): param_groups[{g}]['params'][{i}] is "
                    f"parameter '{fqn}' ({owner}.{attr}) as it was before fully_shard replaced it "
                    "with a DTensor parameter: this optimizer would update a tensor the model no "
                    "longer reads, so the model would never train (torch's FSDP2 runs on "
                    "silently). Build the optimizer after fully_shard, from model.parameters()")
    ref = seen[0] if seen is not None and seen[0]() is optimizer else weakref.ref(
        optimizer, lambda _, key=key: _checked_groups.pop(key, None))
    _checked_groups[key] = (ref, len(optimizer.param_groups))


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError naming the parameter if `optimizer` does not fit sharded `model`.

    Args:
        model: the model after fully_shard (or FullyShardedDataParallel).
        optimizer: the optimizer that is to train it.
    """
    module = getattr(model, "_fsdp_wrapped_module", model)
    if not units_of(module):
        raise ValueError(f"{type(module).__name__} has no fully_shard units; check the optimizer "
                         "against the sharded model")
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    slots = [slot for unit in units_of(module) for bucket in unit.buckets for slot in bucket.slots]
    full_shapes = {id(slot.param): slot.shape for slot in slots}
    replaced = {id(original): names.get(id(slot.param), "?") for slot in slots
                if (original := slot.replaced()) is not None}
    by_shape = {tuple(shape): names.get(pid, "?") for pid, shape in full_shapes.items()}
    covered = 0
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if id(param) in names:
                covered += 1
                continue
            if id(param) in replaced:
                raise ValueError(
                    f"optimizer param_groups[{g}]['params'][{i}] is parameter "
                    f"'{replaced[id(param)]}' as it was before fully_shard, which replaced it "
                    "with a DTensor parameter (as torch's fully_shard does): the optimizer would "
                    "step a tensor the model no longer reads. Build the optimizer after "
                    "fully_shard, from model.parameters()")
            hint = ""
            if (twin := by_shape.get(tuple(param.shape))) is not None:
                hint = f"; it has the unsharded shape of '{twin}'"
            raise ValueError(
                f"optimizer param_groups[{g}]['params'][{i}] (shape {list(param.shape)}) is not a "
                f"parameter of the sharded {type(module).__name__}{hint}: the optimizer was built "
                "over another model (the unwrapped one, or a copy made before fully_shard). Build "
                "it from model.parameters() of the sharded model")
    if covered == 0:
        raise ValueError("the optimizer holds none of the sharded model's parameters")
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"optimizer state '{key}' of parameter '{names.get(id(param), '?')}' has shape "
                    f"{list(value.shape)}, the parameter's local shard is {list(param.shape)}: the "
                    "optimizer stepped before fully_shard. Build the optimizer after sharding, or "
                    "load its saved state into a fresh one")
