"""What torch's FSDPModule setters change on a unit after it was built (api/fsdp_module.py says
what each means to a user), changed only through these methods: the unit owns the fields."""
from __future__ import annotations


class UnitSettings:
    """Mixed into runtime.unit.Unit; `_init_settings` runs in its constructor."""

    def _init_settings(self, reshard_after_forward: bool | None) -> None:
        self.reshard_after_forward = reshard_after_forward  # None: True unless root
        self.requires_gradient_sync = True
        self.requires_all_reduce = True      # HSDP: False defers the all-reduce (grads.py)
        self.reshard_after_backward = True   # False: stay unsharded from backward to next forward
        self.unshard_in_backward = True      # False: backward needs none of the parameters
        self.gradient_divide_factor: float | None = None
        self.all_reduce_hook = None          # hook(reduced shard) before the epilogue
        self.forward_prefetch_units: list | None = None   # explicit lists replace depth
        self.backward_prefetch_units: list | None = None
        self.separate_reduce_scatter = False  # reductions on their own group (Groups made it)

    def set_requires_gradient_sync(self, enabled: bool) -> None:
        self.requires_gradient_sync = self.requires_all_reduce = enabled

    def set_requires_all_reduce(self, enabled: bool) -> None:
        self.requires_all_reduce = enabled

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.gradient_divide_factor = float(factor)

    def set_all_reduce_hook(self, hook) -> None:
        self.all_reduce_hook = hook

    def set_reshard_after_forward(self, enabled: bool) -> None:
        self.reshard_after_forward = enabled

    def set_reshard_after_backward(self, enabled: bool) -> None:
        self.reshard_after_backward = enabled

    def set_separate_reduce_scatter(self, enabled: bool) -> None:
        self.separate_reduce_scatter = enabled

    def set_unshard_in_backward(self, enabled: bool) -> None:
        self.unshard_in_backward = enabled

    def set_prefetch_units(self, forward: list | None = None, backward: list | None = None) -> None:
        """set_modules_to_forward_prefetch / set_modules_to_backward_prefetch (None: unchanged)."""
        if forward is not None:
            self.forward_prefetch_units = forward
        if backward is not None:
            self.backward_prefetch_units = backward
