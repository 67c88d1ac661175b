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

import sys

import torch
from torch import nn

from ..placement import dtensor_params
from ..bucket import gather
from .backward_uses import BackwardUses, add_grads
from ..bucket.bucket import Bucket, set_module_param
from ..bucket.grads import reduce_bucket
from ..bucket.param_buckets import init_sharded_state
from .states import GATHERED, Installed, ShardedState, StateError, move


class _UnshardedViews(torch.autograd.Function):
    """Forward: the parameter views of the unit's trainable buckets. Backward: their gradients go
    to the unit's gradient path; nothing flows back into the flat buffers. Its inputs are the
    gathered buffers and the sharded parameters (`graph_params`), so that autograd's graph leads
    from the forward to the parameters, as it does for a module's own."""

    @staticmethod
    def forward(ctx, unit, *inputs: torch.Tensor):
        ctx.unit = unit
        ctx.params = inputs[len(unit.params.grad_indices):]
        ctx.set_materialize_grads(False)  # unused parameters arrive as None, not zeros
        views = []
        for index, full in zip(unit.params.grad_indices, inputs):
            views.extend(unit.params.buckets[index].full_views(full))
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        nothing = (None,) * (1 + len(unit.params.grad_indices) + len(ctx.params))
        # torch's pipelining runs its backwards with gradient sync off: only then can this be its
        # weight pass (the stack walk stays off the usual path)
        if ctx.params and not unit.requires_gradient_sync and _in_weight_pass():
            unit.params.hold_weight_pass(unit, grads)
            return nothing[:len(nothing) - len(ctx.params)] + tuple(
                torch.zeros_like(param) for param in ctx.params)
        unit.post_backward(unit.params.uses.arrived(ctx, grads, unit.params.take_held()))
        return nothing


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
        # torch's pipelining weight passes since the unit's last backward: their gradients summed
        # in the parameter dtype, as that pass sums them into .grad (see hold_weight_pass)
        self.held: tuple | None = None

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
                unit, *(self.buckets[i].full for i in self.grad_indices), *self.graph_params())
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

    def hold_weight_pass(self, unit, grads: tuple) -> None:
        """A weight pass of torch's pipelining (ZBV, zero bubble, DualPipeV) brought `grads`.
        torch's FSDP2 receives them as its stage writes them, `param.grad = dw`, then
        `param.grad += dw` in the parameter dtype for later weight passes. Where it reduces in
        another dtype (bf16 parameters, fp32 reduction) it moves that sum into its reduce-dtype
        accumulator only at the unit's next backward (an input pass, or a whole backward, whose
        gradients first add to it) or at the stage's reduction: held here until then. Where the
        dtypes are the same, .grad is its accumulator: each pass goes in at once. Either way the
        result is torch's bit for bit."""
        self.held = grads if self.held is None else tuple(
            add_grads(h, g) for h, g in zip(self.held, grads))
        if unit.mp.reduce_dtype in (None, *(self.buckets[i].full.dtype for i in self.grad_indices)):
            self.flush_held(unit)

    def take_held(self) -> tuple | None:
        held, self.held = self.held, None
        return held

    def flush_held(self, unit) -> None:
        """The held weight-pass sum into `unit`'s gradient path, where torch's FSDP2 moves its
        .grad: into the no_sync accumulators at an input pass of the unit (gradient sync off), or
        reduced with them at the stage's reduction (on)."""
        held = self.take_held()
        if held is None:
            return
        grads = iter(held)
        for index in self.grad_indices:
            bucket = self.buckets[index]
            reduce_bucket(unit, bucket, [next(grads) for _ in bucket.slots])

    def graph_params(self) -> list[torch.Tensor]:
        """The sharded parameters, as inputs of the views' autograd node: they receive no
        gradient from it (the unit's gradient path fills their .grad), but autograd's graph then
        leads from the forward to them, as a module's parameters do, for what walks it by
        parameter (torch's pipelining splits backward into input and weight passes so)."""
        return [slot.param for i in self.grad_indices for slot in self.buckets[i].slots
                if slot.param.requires_grad]

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
        self.held = None

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


def _in_weight_pass() -> bool:
    """Whether this backward runs inside torch's pipelining weight pass
    (torch/distributed/pipelining/_backward.py `stage_backward_weight`, torch 2.14): an
    `autograd.grad` over the stage's parameters, which refuses a parameter it gets no gradient
    for. The sharded parameters get zeros there (the pass adds them to .grad, torch's stage
    ~325-337; the gradient path's reduction adds the real gradient at the stage's
    `perform_reduce_grad`); anywhere else None (the gradient path fills .grad)."""
    from torch.distributed.pipelining import _backward
    target = _backward.stage_backward_weight.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is target:
            return True
        frame = frame.f_back
    return False
