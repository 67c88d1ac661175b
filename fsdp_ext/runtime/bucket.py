"""A bucket: the parameters of one unit that share (dtype, requires_grad), laid out in one flat buffer.

Layout of the flat index space (numel_padded elements):

    | p0 | pad | p1 | pad | ... | pN | tail pad |
      ^ each parameter starts on a multiple of ALIGN elements (aligned vector loads on GPUs)
                                          ^ total padded to a multiple of the shard world size

Rank r of the shard group owns elements [r * shard_numel, (r + 1) * shard_numel). A parameter's local
part is its intersection with that range (possibly empty); while sharded, the user's nn.Parameter is
a 1-D view of exactly that part of the local shard, so optimizers keep the same objects and their
state is sharded for free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .. import ops

ALIGN = 8  # elements; 16 bytes at bf16, 32 at fp32


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass
class ParamSlot:
    """One distinct parameter of a bucket and every (module, attribute) that refers to it."""

    param: nn.Parameter
    fqn: str                                   # first name under the unit's module
    locations: list[tuple[nn.Module, str]]     # tied weights have several
    shape: torch.Size
    offset: int                                # start in the flat index space

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class Bucket:
    """Flat sharded storage for one (dtype, requires_grad) group of a unit."""

    dtype: torch.dtype
    requires_grad: bool
    slots: list[ParamSlot]
    world_size: int
    rank: int
    numel_padded: int = 0
    shard_numel: int = 0
    split_sizes: list[int] = field(default_factory=list)  # param pieces and gaps, in order
    piece_indices: list[int] = field(default_factory=list)  # which split pieces are parameters
    shard: torch.Tensor | None = None                     # [shard_numel] original dtype
    grad_shard: torch.Tensor | None = None                # [shard_numel] original dtype
    shard_views: list[torch.Tensor] = field(default_factory=list)
    grad_views: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        offset = 0
        self.split_sizes = []
        for slot in self.slots:
            start = _round_up(offset, ALIGN)
            if start > offset:
                self.split_sizes.append(start - offset)
            slot.offset = start
            self.split_sizes.append(slot.numel)
            offset = start + slot.numel
        self.numel_padded = _round_up(max(offset, 1), self.world_size)
        if self.numel_padded > offset:
            self.split_sizes.append(self.numel_padded - offset)
        self.shard_numel = self.numel_padded // self.world_size
        self.piece_indices = self._param_piece_indices()

    # ---- ranges -------------------------------------------------------------------------------
    @property
    def shard_start(self) -> int:
        return self.rank * self.shard_numel

    def local_range(self, slot: ParamSlot) -> tuple[int, int]:
        """The part of `slot` this rank owns, as [start, end) offsets into the local shard."""
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        start = min(max(slot.offset, lo), hi)
        end = max(min(slot.offset + slot.numel, hi), start)
        return start - lo, end - lo

    def _param_piece_indices(self) -> list[int]:
        """Indices into split_sizes of the pieces that are parameters (the rest is padding)."""
        indices, offset, k = [], 0, 0
        for i, size in enumerate(self.split_sizes):
            if k < len(self.slots) and offset == self.slots[k].offset and size == self.slots[k].numel:
                indices.append(i)
                k += 1
            offset += size
        return indices

    # ---- sharded state --------------------------------------------------------------------------
    def init_shard(self, shard: torch.Tensor) -> None:
        """Copy this rank's part of every parameter into `shard` (no full-bucket temporary)."""
        self.shard = shard
        with torch.no_grad():
            sources = [s.param.detach().to(shard.device).contiguous() for s in self.slots]
            ops.pack(sources, [s.offset for s in self.slots], self.shard, self.shard_start)
        self.shard_views = [self.shard[slice(*self.local_range(s))] for s in self.slots]
        self.point_params_at_shard()

    def point_params_at_shard(self) -> None:
        for slot, view in zip(self.slots, self.shard_views):
            slot.param.data = view

    def ensure_grad_shard(self) -> None:
        if self.grad_shard is None:  # pinned like an offloaded shard, whose grads stay on the host
            self.grad_shard = torch.zeros_like(self.shard, pin_memory=self.shard.is_pinned())
            self.grad_views = [self.grad_shard[slice(*self.local_range(s))] for s in self.slots]

    def release_grad_shard_if_unused(self) -> None:
        """Drop the sharded gradient buffer once no parameter's .grad refers to it.

        After `zero_grad(set_to_none=True)` every .grad is None; keeping the buffer would hold a
        shard of gradients through the next forward, where activations peak (PyTorch's FSDP2 and
        DDP free them there too). The next epilogue allocates it again and overwrites it.
        """
        if self.grad_shard is not None and all(s.param.grad is None for s in self.slots):
            self.grad_shard, self.grad_views = None, []

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
            elif view.numel() and g.data_ptr() != view.data_ptr():
                view.copy_(g.reshape(-1))
        return True

    def sharded_bytes(self) -> int:
        return self.shard_numel * self.shard.element_size() if self.shard is not None else 0
