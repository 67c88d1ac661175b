"""A bucket: the parameters of one unit that share (dtype, requires_grad), and the one owner of
every tensor they have. Nothing outside this class assigns them; its methods are the transitions.

    shard       [S]            this rank's part of every parameter (the all-gather input)
    grad_shard  [S]            the same for the reduced gradients (when a backward made one)
    full        [F]            the gathered buffer autograd sees (parameter views come from it);
    full_data                  its alias: filled, refilled and freed through this one
    chunks                     reshard_after_forward=k: this rank's kept post-forward chunks
    grads                      what the gradient path keeps across micro-batches (grad_state.py)
    wire                       what goes on the wire and how it comes back (wire/exact.py)
    per parameter (ParamSlot): its shard view and gradient view, shaped as the parameter's local
                               tensor (a 1-D range: flat layout; its rows: rows layout), and the
                               gradient's DTensor face (rows layout)

While sharded, a parameter's tensor is a view of the shard: the flat layout swaps the user's
nn.Parameter's `.data` (FSDP1's use_orig_params); the rows layout replaces it with a DTensor
parameter whose local tensor is the view (dtensor_params.py). Either way the optimizer steps on
the shard in place, and its state is sharded like it. `set_module_param` at the end of this file
is the only code that writes a module's `_parameters`.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ... import ops
from ..placement import dtensor_params
from ..core import storage_cache, streams
from .grad_state import BucketGrads
from .layout import BucketLayout
from ..wire.quantized import with_policy
from ..core.offload import host_empty
from ..placement.base import Placement
from ..core.registry import record_replaced

OWNER_ATTR = "_fsdp_ext_owner"  # set on each sharded parameter: which module's unit holds it


@dataclass(eq=False)
class ParamSlot:
    """One distinct parameter of a bucket, every (module, attribute) that refers to it, and its
    views of the bucket's tensors."""

    param: nn.Parameter                        # what the modules hold while sharded
    fqn: str                                   # first name under its module (the member)
    locations: list[tuple[nn.Module, str]]     # tied weights have several
    shape: torch.Size                          # the shape sharded here (global, or TP-local)
    replaced: object = lambda: None            # weak reference to what `param` replaced, if any
    placement: Placement = field(default_factory=Placement)  # where it is sharded (placement/)
    member: int = 0                            # which of the unit's modules holds it (lists)
    shard_view: torch.Tensor | None = None     # its part of the shard (a subclass: its chunk)
    grad_view: torch.Tensor | None = None      # its part of the gradient shard
    grad_face: torch.Tensor | None = None      # what `.grad` holds: grad_view, or a DTensor of it

    @property
    def numel(self) -> int:
        return self.shape.numel()


class Bucket:
    """Sharded, gathered and gradient storage of one (dtype, requires_grad) group of a unit."""

    def __init__(self, dtype: torch.dtype, requires_grad: bool, slots: list[ParamSlot],
                 layout: BucketLayout, wire, groups, spec_of=None):
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.slots = slots
        self.layout = layout
        self.wire = wire                 # chosen by param_buckets.py; a CommPolicy may replace it
        self.groups = groups             # who its collectives talk to: its unit's, or its mesh's
        self.spec_of = spec_of           # rows layout: index -> DTensorSpec of the parameter
        self.shard: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.full: torch.Tensor | None = None
        self.full_data: torch.Tensor | None = None
        self.chunks: list[torch.Tensor] | None = None
        self.grads = BucketGrads()

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def full_numel(self) -> int:
        return self.layout.full_numel

    @property
    def distributed(self) -> bool:
        """Whether the parameters are DTensors (the rows layout with a process group)."""
        return self.spec_of is not None

    @property
    def shard_views(self) -> list[torch.Tensor]:
        return [s.shard_view for s in self.slots]

    @property
    def grad_views(self) -> list[torch.Tensor]:
        return [s.grad_view for s in self.slots]

    # ---- views --------------------------------------------------------------------------------
    def local_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's part of a shard-shaped [S] tensor, shaped as its local tensor."""
        return [flat[slice(*self.layout.local_range(i))].view(self.layout.local_shape(i))
                for i in range(len(self.slots))]

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's gathered data in the gathered buffer `full`, in its own shape (a
        subclass bucket: what its post-hooks built)."""
        return self.wire.full_views(self, full)

    def buffer_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's place in a flat full-size buffer of this bucket's layout."""
        return [full.narrow(0, s.full_offset, s.numel).view(s.shape) for s in self.layout.slots]

    # ---- construction -------------------------------------------------------------------------
    def init_gathered(self, device: torch.device, param_dtype: torch.dtype | None) -> None:
        """The gathered buffer, without storage until first gathered (a subclass bucket's is an
        empty anchor that takes it into the unit's autograd function and names the gradients'
        dtype: wire/subclass.py)."""
        full = torch.empty(self.wire.gathered_numel(self), dtype=param_dtype or self.dtype,
                           device=device)
        streams.free_storage(full)
        full.requires_grad_(self.requires_grad)
        self.full, self.full_data = full, full.data

    def init_shard(self, shard: torch.Tensor, sources: list[torch.Tensor]) -> None:
        """Make `shard` this rank's shard of `sources` (the parameters' full values; none read
        when they or the shard are on the meta device) and point the parameters at it."""
        self.shard = shard
        if not shard.is_meta and not any(t.is_meta for t in sources):
            self.fill_shard(sources)
        self._set_shard_views(self.local_views(shard))
        self.point_params_at_shard()

    def new_shard(self, device: torch.device, offload) -> torch.Tensor:
        """Storage for the shard, every element zero (on the host under CPU offload).

        Invariant: a shard's padding (what no parameter's piece covers: a short chunk's missing
        rows, each piece's round-up to ALIGN) is zero from its allocation on, and nothing writes
        it later (the optimizer and every load write the parameters' views). Exact gathers never
        read it, but a CommPolicy's quantized gather puts it in its parameter's last block, where
        anything but zero enters the block's scale (NaN poisons the parameter). So every
        allocation of a shard, at fully_shard and when a meta shard gets storage (after
        `to_empty`), comes here.
        """
        if offload is not None:
            return host_empty(self.shard_numel, self.dtype, offload.pin_memory, device).zero_()
        return torch.zeros(self.shard_numel, dtype=self.dtype, device=device)

    def become_dtensors(self, views: list[torch.Tensor]) -> None:
        """The modules' parameters become DTensor parameters over `views`, this rank's part of
        each (same names, attributes). What each replaced is still referenced by a module outside
        the unit only if it is tied to one there: then the parent's fully_shard names both."""
        params = []
        for index, (slot, view) in enumerate(zip(self.slots, views)):
            param = dtensor_params.make_param(view, self.spec_of(index), slot.param.requires_grad)
            mark_owner(param, getattr(slot.param, OWNER_ATTR))
            slot.replaced = weakref.ref(slot.param)
            owner, attr = slot.locations[0]
            record_replaced(slot.param, (type(owner).__name__, attr, slot.fqn))
            params.append(param)
        self.replace_params(params)

    def init_subclass_shard(self, chunks: list[torch.Tensor]) -> None:
        """A subclass bucket's shard: each parameter's chunk, its own subclass (no flat shard)."""
        self._set_shard_views(chunks)

    def _set_shard_views(self, views: list[torch.Tensor]) -> None:
        for slot, view in zip(self.slots, views):
            slot.shard_view = view

    def replace_params(self, params: list[nn.Parameter]) -> None:
        """The slots' parameters become `params` (construction: DTensor parameters over the
        shard views; adoption: what `_apply` or `load_state_dict(assign=True)` gave the modules),
        set as every module attribute that holds them."""
        for slot, param in zip(self.slots, params):
            slot.param = param
            for module, attr in slot.locations:
                set_module_param(module, attr, param)

    def fill_shard(self, sources: list[torch.Tensor]) -> None:
        """Copy (and cast) this rank's part of each full-shape source into the shard, padding
        zeroed: one pack over the whole shard."""
        with torch.no_grad():
            parts, offsets = [], []
            for i, source in enumerate(sources):
                part = self.layout.local_part(i, source.detach())
                parts.append(part.reshape(-1).to(self.shard.device))
                offsets.append(self.layout.local_range(i)[0])
            ops.pack([p.contiguous() for p in parts], offsets, self.shard, 0)

    def give_shard_storage(self, shard: torch.Tensor) -> None:
        """A meta shard gets storage (after `to_empty`): zeroed, padding included."""
        self.shard = shard
        self._set_shard_views(self.local_views(shard))

    def adopt(self, params: list[nn.Parameter], locals_: list[torch.Tensor]) -> None:
        """The modules hold `params` (new tensors from `_apply` / `load_state_dict(assign=True)`):
        their values go into the shard and they view it again."""
        self.replace_params(params)
        self.wire.adopt(self, locals_)

    def copy_into_shard(self, locals_: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for slot, local in zip(self.slots, locals_):
                view = slot.shard_view
                if view.numel() and local.data_ptr() != view.data_ptr():
                    view.copy_(local.reshape(view.shape))
        self.point_params_at_shard()

    def point_params_at_shard(self) -> None:
        """The modules' parameters become this rank's shard views again (FSDP1: the user's
        nn.Parameter objects, `.data` swapped; rows layout: DTensor parameters over them)."""
        for slot in self.slots:
            if self.distributed:
                dtensor_params.set_local(slot.param, slot.shard_view)
            else:
                slot.param.data = slot.shard_view

    def point_params_at(self, tensors: list[torch.Tensor]) -> None:
        """FSDP1's summon_full_params: the user's parameters' `.data` become full tensors."""
        for slot, tensor in zip(self.slots, tensors):
            slot.param.data = tensor

    # ---- gathered state -----------------------------------------------------------------------
    def start_fill(self) -> None:
        storage_cache.fill(self.full_data)

    def keep_chunks(self, world: int, k: int, index: int, make_chunks) -> None:
        self.chunks = make_chunks(self, self.full_data, world, k, index)

    def take_chunks(self) -> list[torch.Tensor] | None:
        chunks, self.chunks = self.chunks, None
        return chunks

    def free_gathered(self) -> None:
        storage_cache.release(self.full_data)
        self.wire.release(self)

    def holds_unsharded_memory(self) -> bool:
        return self.full_data.untyped_storage().size() > 0 or self.wire.holds_memory(self)

    def on_meta(self) -> bool:
        return self.wire.on_meta(self)

    def use_comm_policy(self, policy) -> None:
        """The unit's CommPolicy in effect (None: exact), known when its root first runs."""
        self.wire = with_policy(self.wire, policy)

    # ---- gradients ----------------------------------------------------------------------------
    def ensure_grad_shard(self) -> None:
        if self.grad_shard is None:
            self.grad_shard = self.wire.new_grad_shard(self)
            for i, (slot, view) in enumerate(zip(self.slots, self.local_views(self.grad_shard))):
                slot.grad_view = view
                slot.grad_face = (dtensor_params.as_dtensor(view, self.spec_of(i))
                                  if self.distributed else view)

    def release_grad_shard_if_unused(self) -> None:
        """Drop the sharded gradient buffer once no parameter's .grad refers to it.

        After `zero_grad(set_to_none=True)` every .grad is None; keeping the buffer would hold a
        shard of gradients through the next forward, where activations peak (PyTorch's FSDP2 and
        DDP free them there too). The next epilogue allocates it again and overwrites it.
        """
        if self.grad_shard is not None and all(s.param.grad is None for s in self.slots):
            self.grad_shard = None
            for slot in self.slots:
                slot.grad_view = slot.grad_face = None

    def sync_param_grads_into_buffer(self) -> bool:
        """Adopt whatever the user left in `param.grad` before a new gradient lands.

        Returns whether the new gradient accumulates (False: every grad was None, as after
        `zero_grad(set_to_none=True)`, so the epilogue overwrites instead of reading stale values).
        """
        self.ensure_grad_shard()
        grads = [slot.param.grad for slot in self.slots]
        if all(g is None for g in grads):
            return False
        for g, slot in zip(grads, self.slots):
            if g is None:
                slot.grad_view.zero_()
                continue
            local = dtensor_params.local_of(g)
            if slot.grad_view.numel() and local.data_ptr() != slot.grad_view.data_ptr():
                slot.grad_view.copy_(local.reshape(slot.grad_view.shape))
        return True

    def publish_grad(self, index: int) -> None:
        """Point parameter `index`'s .grad at its part of the gradient shard."""
        self.slots[index].param.grad = self.slots[index].grad_face

    def unpublish_grad(self, index: int) -> None:
        """Parameter `index`'s .grad back to None, unless something else replaced it since."""
        slot = self.slots[index]
        if slot.param.grad is slot.grad_face:
            slot.param.grad = None

    def set_param_grads(self, grads: list[torch.Tensor | None]) -> None:
        """summon_full_params(with_grads=True): the user's parameters' `.grad` become full ones."""
        for slot, grad in zip(self.slots, grads):
            slot.param.grad = grad

    def drop_gradient_state(self) -> None:
        """After a failed backward: no_sync accumulation, HSDP partial sums and flags are the
        failed step's; dropped, not applied."""
        self.grads = BucketGrads()

    def sharded_bytes(self) -> int:
        return self.wire.sharded_bytes(self)


def set_module_param(module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
    """The one writer of a module's `_parameters` after fully_shard took it (and while it
    materialises meta modules): the sharded parameter, a view of the gathered buffer, or a full
    copy (summon_full_params)."""
    module._parameters[attr] = tensor


def mark_owner(param: torch.Tensor, owner: str | None) -> None:
    """Say on a sharded parameter which unit holds it (a second fully_shard of it is refused)."""
    setattr(param, OWNER_ATTR, owner)
