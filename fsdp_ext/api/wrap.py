"""Auto-wrap for FullyShardedDataParallel: which submodules become units, as FSDP1 decides.

The policies are torch's own (`torch.distributed.fsdp.wrap`, exported as they are): a callable
with FSDP1's convention `policy(module=, recurse=, nonwrapped_numel=)` (size_based, transformer,
lambda, always_wrap, or the user's), or a policy object (ModuleWrapPolicy, CustomPolicy) whose
`_run_policy` names the modules and, for CustomPolicy, per-module arguments. The traversal below
is FSDP1's: bottom-up, the root excluded (it is wrapped last), ignored modules and parameters
left out of the counts. Two differences: a ModuleList or ModuleDict is never made a unit (its own
forward never runs, so its parameters could never be gathered; torch's size-based policy skips
them too), and with mixed precision the classes in MixedPrecision._module_classes_to_ignore
(BatchNorm by default) become units of their own in full precision, their inputs cast to fp32 and
outputs back, as torch does.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp.wrap import (CustomPolicy, ModuleWrapPolicy, _Policy,  # noqa: F401
                                         always_wrap_policy, lambda_auto_wrap_policy,
                                         size_based_auto_wrap_policy,
                                         transformer_auto_wrap_policy)
from torch.utils._pytree import tree_map

from ..runtime.core.registry import unit_of

NEVER_UNITS = (nn.ModuleList, nn.ModuleDict)  # containers whose forward() is never called


def apply_auto_wrap(root: nn.Module, policy, wrap: Callable[..., nn.Module],
                    ignored_modules: set, ignored_params: set, root_kwargs: dict) -> None:
    """Call `wrap(module, **overrides)` bottom-up on every strict submodule of `root` that
    `policy` selects."""
    mixed_precision = root_kwargs.get("mixed_precision")
    full_precision = tuple(mixed_precision._module_classes_to_ignore) if mixed_precision else ()
    if isinstance(policy, _Policy):
        targets = policy._run_policy(root, ignored_modules, dict(root_kwargs))
        overrides = {m: {k: v for k, v in kw.items() if kw is not root_kwargs and
                         root_kwargs.get(k, _MISSING) is not v}
                     for m, kw in targets.items()}
        select = None
    elif callable(policy):
        overrides, select = {}, policy
    else:
        raise TypeError(f"auto_wrap_policy must be a policy or a callable, got {type(policy).__name__}")
    for module in root.modules():
        if full_precision and isinstance(module, full_precision) and module not in ignored_modules:
            overrides.setdefault(module, {})["mixed_precision"] = None
            _cast_to_fp32_around(module)

    def chosen(module: nn.Module, nonwrapped: int) -> bool:
        if select is not None and select(module=module, recurse=False, nonwrapped_numel=nonwrapped):
            return True
        return module in overrides

    def visit(module: nn.Module) -> int:
        """Returns how many of the subtree's (not ignored) parameters ended up in units."""
        total = sum(p.numel() for p in module.parameters() if p not in ignored_params)
        if unit_of(module) is not None:
            return total
        if select is not None and not select(module=module, recurse=True, nonwrapped_numel=total):
            return 0
        wrapped = sum(visit(child) for child in module.children() if child not in ignored_modules)
        if module is not root and not isinstance(module, NEVER_UNITS) and chosen(
                module, total - wrapped):
            wrap(module, **overrides.get(module, {}))
            return total
        return wrapped

    visit(root)


_MISSING = object()


def _cast_to_fp32_around(module: nn.Module) -> None:
    """A full-precision unit inside a mixed-precision model: inputs in fp32, outputs back in the
    dtype the inputs came in (torch's FSDP1 does the same for these classes)."""
    seen: dict[str, torch.dtype] = {}

    def cast(dtype):
        def to(x):
            if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
                seen.setdefault("dtype", x.dtype)
                return x.to(dtype)
            return x
        return to

    def before(mod, args):
        seen.clear()
        return tree_map(cast(torch.float32), args)

    def after(mod, args, output):
        if "dtype" in seen:
            return tree_map(cast(seen["dtype"]), output)
        return output

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
