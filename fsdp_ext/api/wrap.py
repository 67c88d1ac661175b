"""Auto-wrap policies with FSDP1's calling convention: `policy(module, recurse, nonwrapped_numel)`.

With recurse=True the policy says whether to look inside `module`; with recurse=False whether to make
`module` a unit, given the parameters not already claimed by units below it.
"""
from __future__ import annotations

from typing import Callable, Iterable

from torch import nn

from ..runtime.registry import unit_of


class ModuleWrapPolicy:
    """Make a unit of every module whose class is in `module_classes`."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self.module_classes = tuple(module_classes)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else isinstance(module, self.module_classes)


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8)) -> bool:
    """Make a unit of any module holding at least `min_num_params` not-yet-wrapped parameters."""
    return True if recurse else nonwrapped_numel >= min_num_params


def _as_callable(policy) -> Callable[[nn.Module, bool, int], bool]:
    """Accept our policies, plain callables, and torch.distributed.fsdp.wrap.ModuleWrapPolicy."""
    classes = getattr(policy, "_module_classes", None)
    if classes is not None:  # torch's ModuleWrapPolicy
        return ModuleWrapPolicy(classes)
    if callable(policy):
        return lambda m, recurse, n: policy(module=m, recurse=recurse, nonwrapped_numel=n)
    raise TypeError(f"auto_wrap_policy must be a policy or a callable, got {type(policy).__name__}")


def apply_auto_wrap(root: nn.Module, policy, wrap: Callable[[nn.Module], None]) -> None:
    """Call `wrap` bottom-up on every strict submodule of `root` that the policy selects."""
    policy_fn = _as_callable(policy)

    def visit(module: nn.Module) -> int:
        """Returns the number of parameters of `module`'s subtree that ended up in units."""
        if unit_of(module) is not None:
            return sum(p.numel() for p in module.parameters())
        total = sum(p.numel() for p in module.parameters())
        if not policy_fn(module, True, total):
            return 0
        wrapped = sum(visit(child) for child in module.children())
        if module is not root and policy_fn(module, False, total - wrapped):
            wrap(module)
            return total
        return wrapped

    visit(root)
