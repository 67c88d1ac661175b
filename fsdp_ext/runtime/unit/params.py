"""A unit's parameters as a whole: its buckets (bucket.py owns each one's tensors), the all-gather
in flight (with its pending copy-out), the sharded state and what the modules' parameter
attributes hold. Its transitions `install_unsharded` / `install_sharded` (and `install_full` for
summon_full_params) decide what the modules hold, through the bucket module's one writer.

The views the forward sees come from `_UnshardedViews`, an autograd function whose backward
receives the per-parameter gradients (None for parameters the forward did not use) and hands them
to the unit's gradient path (grads.py) instead of returning them to autograd. Freeing takes a
buffer's storage down to zero bytes (`storage_cache.release`, like `untyped_storage().resize_(0)`),
which keeps every view and every tensor autograd saved valid; the refill (`storage_cache.fill`)
writes through `full_data`, an alias with its own version counter, so autograd does not mistake
the refill for an in-place edit of the tensors it saved.
"""
from __future__ import annotations

import torch
from torch import nn

from ..placement import dtensor_params
from ..bucket import gather
from .backward_uses import BackwardUses
from ..bucket.bucket import Bucket, set_module_param
from ..bucket.param_buckets import init_sharded_state
from .states import GATHERED, Installed, ShardedState, StateError, move


class _UnshardedViews(torch.autograd.Function):
    """Forward: the parameter views of the unit's trainable buckets. Backward: their gradients go
    to the unit's gradient path; nothing flows back into the flat buffers."""

    @staticmethod
    def forward(ctx, unit, *fulls: torch.Tensor):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # unused parameters arrive as None, not zeros
        views = []
        for index, full in zip(unit.params.grad_indices, fulls):
            views.extend(unit.params.buckets[index].full_views(full))
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward(ctx.unit.params.uses.arrived(ctx, grads))
        return (None,) * (1 + len(ctx.unit.params.grad_indices))


class UnitParams:
    def __init__(self, name: str, buckets: list[Bucket], device: torch.device,
                 param_dtype: torch.dtype | None, offload) -> None:
        self.name = name                 # the unit's, for messages (the root names units late)
        self.buckets = buckets
        init_sharded_state(buckets, device, offload, param_dtype)
        self.grad_indices = [i for i, b in enumerate(buckets) if b.requires_grad]
        self.sharded_state = ShardedState.SHARDED
        self.installed = Installed.SHARDED
        self.in_flight: gather.InFlightGather | None = None
        self._no_grad_views: list[tuple[nn.Module, str, torch.Tensor]] | None = None
        self.uses = BackwardUses()       # the forward uses whose backward is still to come

    def rename(self, name: str) -> None:
        self.name = name

    def gathered(self) -> bool:
        """Unsharded, or an all-gather into the buffers in flight."""
        return self.sharded_state in GATHERED

    def holds_unsharded_memory(self) -> bool:
        return any(b.holds_unsharded_memory() for b in self.buckets)

    # ---- sharded state -----------------------------------------------------------------------
    def take_chunks(self) -> list[list[torch.Tensor]] | None:
        """The post-forward chunks to regather from (SHARDED_POST_FORWARD), or None."""
        if self.sharded_state is not ShardedState.SHARDED_POST_FORWARD:
            return None
        chunks = [b.take_chunks() for b in self.buckets]
        move(self, "sharded_state", ShardedState.SHARDED, (ShardedState.SHARDED_POST_FORWARD,),
             "regather from the post-forward chunks")
        return chunks

    def drop_chunks(self) -> None:
        """Chunks kept for a backward that did not use them belong to their step only."""
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            for bucket in self.buckets:
                bucket.take_chunks()
            move(self, "sharded_state", ShardedState.SHARDED,
                 (ShardedState.SHARDED_POST_FORWARD,), "drop the post-forward chunks")

    def started_unshard(self, in_flight: gather.InFlightGather | None) -> None:
        """An all-gather was launched (None: nothing to gather, the unit is unsharded now)."""
        move(self, "sharded_state", ShardedState.UNSHARDING if in_flight else
             ShardedState.UNSHARDED, (ShardedState.SHARDED,), "unshard")
        self.in_flight = in_flight

    def finish_unshard(self) -> None:
        """Wait for the all-gather in flight (copy-out included), if any."""
        if self.in_flight is None:
            return
        in_flight, self.in_flight = self.in_flight, None
        in_flight.finish()
        move(self, "sharded_state", ShardedState.UNSHARDED, (ShardedState.UNSHARDING,),
             "the all-gather's wait")

    def free(self, keep_chunks: bool) -> None:
        """UNSHARDED -> SHARDED, releasing the buffers; `keep_chunks`: keep this rank's 1/k
        chunk of each bucket first, k and the chunk's index those of the bucket's post-forward
        group (its unit's, or its own mesh's) (SHARDED_POST_FORWARD)."""
        if keep_chunks:
            for bucket in self.buckets:
                on = bucket.groups
                bucket.keep_chunks(on.shard_size, on.post_forward_size, on.post_forward_rank,
                                   gather.post_forward_chunks)
        for bucket in self.buckets:
            bucket.free_gathered()
        move(self, "sharded_state", ShardedState.SHARDED_POST_FORWARD if keep_chunks else
             ShardedState.SHARDED, (ShardedState.UNSHARDED,), "reshard")

    # ---- what the modules hold ---------------------------------------------------------------
    def install_unsharded(self, unit) -> None:
        """Point every module attribute at a view of the gathered buffers (no copy-out); with
        grad enabled, trainable views come from _UnshardedViews (their backward is `unit`'s)."""
        if self.sharded_state is not ShardedState.UNSHARDED:
            raise StateError(f"unit '{self.name or '<root>'}': parameters installed "
                             f"while {self.sharded_state.name}")
        move(self, "installed", Installed.UNSHARDED, (Installed.SHARDED, Installed.UNSHARDED),
             "install the gathered parameters")
        if not torch.is_grad_enabled():
            for module, attr, view in self.no_grad_views():
                set_module_param(module, attr, view)
            return
        views: dict[int, torch.Tensor] = {}
        if self.grad_indices:
            applied = _UnshardedViews.apply(
                unit, *(self.buckets[i].full for i in self.grad_indices))
            if applied:
                self.uses.add(applied[0].grad_fn, unit.members_running())
            flat_views = iter(applied)
            for i in self.grad_indices:
                for slot in self.buckets[i].slots:
                    views[id(slot)] = next(flat_views)
        for bucket in self.buckets:
            if self.grad_indices and bucket.requires_grad:
                continue
            for slot, view in zip(bucket.slots, bucket.full_views(bucket.full)):
                views[id(slot)] = view
        for bucket in self.buckets:
            for slot in bucket.slots:
                _install(slot, _tp(views[id(slot)], slot))

    def no_grad_views(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """(module, attribute, view of the gathered buffer) for every parameter, made once under
        no_grad and kept where the wire format refills the buffers in their own storages (views
        stay valid). Not kept with subclass parameters: a post-hook's `out=` may give the
        unsharded tensor new attributes (torchao's float8 a new scale), which an earlier alias
        would not see."""
        if self._no_grad_views is None or not all(b.wire.caches_views for b in self.buckets):
            with torch.no_grad():
                self._no_grad_views = [
                    (module, attr, _tp(view, slot))
                    for bucket in self.buckets
                    for slot, view in zip(bucket.slots, bucket.full_views(bucket.full))
                    for module, attr in slot.locations]
        return self._no_grad_views

    def install_sharded(self) -> None:
        """The sharded parameters become the modules' attributes again (no-op if they are)."""
        if self.installed is not Installed.SHARDED:
            self._install_sharded()

    def _install_sharded(self) -> None:
        move(self, "installed", Installed.SHARDED, tuple(Installed), "install the shards")
        for bucket in self.buckets:
            for slot in bucket.slots:
                _install(slot, slot.param)

    def install_full(self, slot, tensor: torch.Tensor) -> None:
        """summon_full_params: `tensor` (a full parameter) becomes `slot`'s attribute."""
        move(self, "installed", Installed.FULL, (Installed.SHARDED, Installed.FULL),
             "summon_full_params")
        _install(slot, tensor)

    def drop_gradient_state(self) -> None:
        """After a failed backward: no_sync accumulation, HSDP partial sums and flags are the
        failed step's; dropped, not applied."""
        for bucket in self.buckets:
            bucket.drop_gradient_state()
        self.uses.clear()

    def params_replaced(self) -> None:
        """adopt_params gave the slots new parameter objects: install them."""
        self._install_sharded()
        self._no_grad_views = None


def _tp(view: torch.Tensor, slot) -> torch.Tensor:
    """What the module computes with over the gathered view (its placement's compute view:
    placement/), marked as a parameter."""
    tensor = slot.placement.compute_view(view)
    # `isinstance(t, nn.Parameter)` answers True, as for torch's gathered parameters, with no
    # copy (nn.Parameter's own test for tensor subclasses made parameters; `get_parameter`,
    # hooks and adapters that inspect modules in forward rely on it).
    tensor._is_param = True
    return tensor


def _install(slot, tensor: torch.Tensor) -> None:
    for module, attr in slot.locations:
        set_module_param(module, attr, tensor)
