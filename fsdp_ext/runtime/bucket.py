"""A bucket: the parameters of one unit that share (dtype, requires_grad), and this rank's shard of
them in one flat buffer laid out by layout.py.

    shard       [S]            this rank's part of every parameter (the all-gather input)
    grad_shard  [S]            the same for the reduced gradients (when a backward made one)
    shard_views / grad_views   per parameter, this rank's part shaped as the parameter's local
                               tensor: a 1-D range (flat layout), or its rows (rows layout)

While sharded, a parameter's tensor is a view of the shard: the flat layout swaps the user's
nn.Parameter's `.data` (FSDP1's use_orig_params); the rows layout replaces it with a DTensor
parameter whose local tensor is the view (dtensor_params.py). Either way the optimizer steps on
the shard in place, and its state is sharded like it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import ops
from . import dtensor_params
from .layout import BucketLayout


@dataclass
class ParamSlot:
    """One distinct parameter of a bucket and every (module, attribute) that refers to it."""

    param: nn.Parameter                        # what the modules hold while sharded
    fqn: str                                   # first name under its module (the member)
    locations: list[tuple[nn.Module, str]]     # tied weights have several
    shape: torch.Size                          # the shape sharded here (global, or TP-local)
    replaced: object = lambda: None            # weak reference to what `param` replaced, if any
    tp_spec: object = None                     # a tensor-parallel DTensor's spec (its TP mesh)
    member: int = 0                            # which of the unit's modules holds it (lists)

    @property
    def numel(self) -> int:
        return self.shape.numel()


class Bucket:
    """Flat sharded storage for one (dtype, requires_grad) group of a unit."""

    extension = False  # tensor-subclass parameters (extension.py) have no flat shard
    comm_policy = None  # its unit's CommPolicy once resolved (comm_policy.py), if it has one

    def __init__(self, dtype: torch.dtype, requires_grad: bool, slots: list[ParamSlot],
                 layout: BucketLayout, spec_of=None):
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.slots = slots
        self.layout = layout
        self.spec_of = spec_of           # rows layout: index -> DTensorSpec of the parameter
        self.shard: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.shard_views: list[torch.Tensor] = []
        self.grad_views: list[torch.Tensor] = []
        self._grads: list = []           # rows layout: the DTensor gradients over grad_views

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

    # ---- views --------------------------------------------------------------------------------
    def local_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's part of a shard-shaped [S] tensor, shaped as its local tensor."""
        return [flat[slice(*self.layout.local_range(i))].view(self.layout.local_shape(i))
                for i in range(len(self.slots))]

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's gathered data in the gathered buffer, in its own shape."""
        return [full.narrow(0, s.full_offset, s.numel).view(s.shape) for s in self.layout.slots]

    # ---- sharded state --------------------------------------------------------------------------
    def init_shard(self, shard: torch.Tensor, sources: list[torch.Tensor]) -> None:
        """Make `shard` this rank's shard of `sources` (the parameters' full values; none read
        when they or the shard are on the meta device) and point the parameters at it."""
        self.shard = shard
        if not shard.is_meta and not any(t.is_meta for t in sources):
            self.fill_shard(sources)
        self.shard_views = self.local_views(shard)
        self.point_params_at_shard()

    def fill_shard(self, sources: list[torch.Tensor]) -> None:
        """Copy (and cast) this rank's part of each full-shape source into the shard, padding
        zeroed: one pack over the whole shard."""
        with torch.no_grad():
            parts, offsets = [], []
            for i, source in enumerate(sources):
                start, end = self.layout.param_range(i)
                parts.append(source.detach().reshape(-1)[start:end].to(self.shard.device))
                offsets.append(self.layout.local_range(i)[0])
            ops.pack([p.contiguous() for p in parts], offsets, self.shard, 0)

    def point_params_at_shard(self) -> None:
        """The modules' parameters become this rank's shard views again (FSDP1: the user's
        nn.Parameter objects, `.data` swapped; rows layout: DTensor parameters over them)."""
        for i, (slot, view) in enumerate(zip(self.slots, self.shard_views)):
            if self.distributed:
                dtensor_params.set_local(slot.param, view)
            else:
                slot.param.data = view

    def ensure_grad_shard(self) -> None:
        if self.grad_shard is None:
            self.grad_shard = self.new_grad_shard()
            self.grad_views = self.local_views(self.grad_shard)
            self._grads = [dtensor_params.as_dtensor(view, self.spec_of(i)) if self.distributed
                           else view for i, view in enumerate(self.grad_views)]

    def new_grad_shard(self) -> torch.Tensor:
        """Zeros like the shard (pinned like an offloaded shard, whose grads stay on the host)."""
        return torch.zeros_like(self.shard, pin_memory=self.shard.is_pinned())

    def release_grad_shard_if_unused(self) -> None:
        """Drop the sharded gradient buffer once no parameter's .grad refers to it.

        After `zero_grad(set_to_none=True)` every .grad is None; keeping the buffer would hold a
        shard of gradients through the next forward, where activations peak (PyTorch's FSDP2 and
        DDP free them there too). The next epilogue allocates it again and overwrites it.
        """
        if self.grad_shard is not None and all(s.param.grad is None for s in self.slots):
            self.grad_shard, self.grad_views, self._grads = None, [], []

    def sync_param_grads_into_buffer(self) -> bool:
        """Adopt whatever the user left in `param.grad` before a new gradient lands.

        Returns whether the new gradient accumulates (False: every grad was None, as after
        `zero_grad(set_to_none=True)`, so the epilogue overwrites instead of reading stale values).
        """
        self.ensure_grad_shard()
        grads = [slot.param.grad for slot in self.slots]
        if all(g is None for g in grads):
            return False
        for g, view in zip(grads, self.grad_views):
            if g is None:
                view.zero_()
                continue
            local = dtensor_params.local_of(g)
            if view.numel() and local.data_ptr() != view.data_ptr():
                view.copy_(local.reshape(view.shape))
        return True

    def publish_grad(self, index: int) -> None:
        """Point parameter `index`'s .grad at its part of the gradient shard."""
        self.slots[index].param.grad = self._grads[index]

    def sharded_bytes(self) -> int:
        return self.shard_numel * self.shard.element_size() if self.shard is not None else 0
