"""Where each parameter of a bucket lives: in every rank's shard, in the gathered buffer, and in the
packed gradients. Index math only (no tensors), shared by the runtime, the state code and the planner.

Two layouts, chosen by the API that built the unit:

* "flat" (FullyShardedDataParallel, FSDP1 with use_orig_params): the parameters lie one after
  another (each ALIGN-aligned) in one flat index space padded to a multiple of W; rank r holds
  [r * S, (r + 1) * S). A parameter's part on a rank is a contiguous range of its flattened
  elements (possibly empty, possibly cutting a row). The gathered buffer is the flat space itself:
  every parameter is a view of it, one collective per bucket.

* "rows" (fully_shard, FSDP2): each parameter is cut along its shard dim d (0 unless a
  shard_placement_fn says Shard(d)) with torch.chunk's semantics, c = ceil(shape[d] / W) rows
  per rank, rank r holding rows [r * c, min((r + 1) * c, shape[d])), which is DTensor's Shard(d).
  A rank's shard holds its chunk of every parameter, contiguous, padded to c rows, so every rank
  sends as many elements as the others. For d > 0 the chunk is `outer` = prod(shape[:d]) blocks
  of the parameter (one per index of the dims before d), each a contiguous range of it: such a
  parameter is gathered into staging and copied out block by block (a copied group), as torch's
  FSDP2 copies out a Shard(d) parameter with a cat along d.

[Note: gather groups] A bucket is gathered by one collective per group. Group g takes the
region [g.shard_offset, g.shard_offset + Q) of every rank's shard (Q = g.shard_numel) and gathers
the W regions rank after rank ("rank-major", W * Q elements):
  * a direct group (flat layout, or one parameter of the rows layout) is gathered straight into the
    gathered buffer at g.full_offset: rank-major *is* the parameters' own order there (the flat
    space; a parameter cut by rows, tail-padded), so parameters are views of it: no copy-out;
  * a copied group (rows layout, several parameters) is gathered into a staging buffer and copied
    out, one launch, into each parameter's own place in the gathered buffer.
Candidates, measured side by side (docs/benchmarks.md, "Gathering DTensor parameters"): every
parameter its own direct group (no copy-out, one collective per parameter), one copied group for
the whole bucket (one collective and a copy-out pass), and a size split (parameters of at least
`direct_min_numel` elements direct, the rest one copied group).
The packed gradients use the same rank-major order per group: group g's block starts at
W * g.shard_offset, so a reduce-scatter of that block leaves rank r exactly its shard region.
Groups start ALIGN-aligned (in the shard, the gathered buffer and the packed gradients); the few
elements between them belong to no group and are never sent.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

ALIGN = 8  # elements; 16 bytes at bf16, 32 at fp32: aligned vector access on every device


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass
class SlotLayout:
    """One parameter of the bucket."""

    shape: tuple[int, ...]
    shard_offset: int        # flat: its start in the flat space; rows: its chunk's start in the shard
    full_offset: int = 0     # where its gathered data starts in the gathered buffer
    chunk_rows: int = 0      # rows: rows per rank (c) along the shard dim; flat: 0
    dim: int = 0             # rows: the shard dim (Shard(dim))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements of one row along the shard dim (of one of the `outer` blocks)."""
        return math.prod(self.shape[self.dim + 1:])

    @property
    def outer(self) -> int:
        """Blocks of the parameter before its shard dim (1 for Shard(0))."""
        return math.prod(self.shape[:self.dim])


@dataclass
class GroupLayout:
    """The parameters gathered by one collective (see [Note: gather groups])."""

    slots: list[int]             # indices into BucketLayout.slots
    shard_offset: int            # start of the group's region in every rank's shard
    shard_numel: int             # Q: elements every rank contributes
    full_offset: int | None      # direct: where its W * Q elements land; None: staged, copied out

    @property
    def copied(self) -> bool:
        return self.full_offset is None


@dataclass
class BucketLayout:
    kind: str                    # "flat" | "rows"
    world_size: int
    rank: int
    slots: list[SlotLayout]
    groups: list[GroupLayout] = field(default_factory=list)
    shard_numel: int = 0         # S: elements of every rank's shard
    full_numel: int = 0          # elements of the gathered buffer

    # ---- what this rank (or any rank) holds ---------------------------------------------------
    def local_rows(self, index: int, rank: int | None = None) -> int:
        """rows: the rows of parameter `index` that `rank` holds (torch.chunk; maybe none)."""
        slot, rank = self.slots[index], self.rank if rank is None else rank
        rows = slot.shape[slot.dim]
        return max(0, min(slot.chunk_rows, rows - rank * slot.chunk_rows))

    def local_shape(self, index: int, rank: int | None = None) -> tuple[int, ...]:
        """The shape of this rank's part of parameter `index` (flat: 1-D)."""
        start, end = self.local_range(index, rank)
        if self.kind == "flat":
            return (end - start,)
        shape, dim = self.slots[index].shape, self.slots[index].dim
        return shape[:dim] + (self.local_rows(index, rank),) + shape[dim + 1:]

    def local_range(self, index: int, rank: int | None = None) -> tuple[int, int]:
        """[start, end) of parameter `index`'s part inside `rank`'s shard."""
        slot, rank = self.slots[index], self.rank if rank is None else rank
        if self.kind == "rows":
            start = slot.shard_offset
            return start, start + slot.outer * self.local_rows(index, rank) * slot.row_numel
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        start = min(max(slot.shard_offset, lo), hi)
        end = max(min(slot.shard_offset + slot.numel, hi), start)
        return start - lo, end - lo

    def param_range(self, index: int, rank: int | None = None) -> tuple[int, int]:
        """[start, end) of the flattened parameter `index` that `rank` holds: one contiguous range
        in both layouts (a chunk of whole rows of a row-major tensor is one), for a parameter
        sharded along its first dim with more than one element (`contiguous`): dim 0, or a later
        dim with only size-1 dims before it (an expert-parallel rank's one expert, [1, in, out],
        sharded Shard(1))."""
        slot, rank = self.slots[index], self.rank if rank is None else rank
        if not self.contiguous(index):
            raise NotImplementedError(
                f"parameter {index} of shape {list(slot.shape)} is sharded along dim {slot.dim}: "
                "its part on a rank is not one range of the flattened parameter")
        if self.kind == "rows":
            first = min(rank * slot.chunk_rows, slot.shape[slot.dim]) * slot.row_numel
            return first, first + self.local_rows(index, rank) * slot.row_numel
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        start = min(max(slot.shard_offset, lo), slot.shard_offset + slot.numel)
        end = max(min(slot.shard_offset + slot.numel, hi), start)
        return start - slot.shard_offset, end - slot.shard_offset

    def contiguous(self, index: int) -> bool:
        """Whether every rank's part of parameter `index` is one range of the flattened parameter
        (flat layout; rows sharded along the first dim with more than one element)."""
        return self.kind == "flat" or self.slots[index].outer == 1

    def local_part(self, index: int, full, rank: int | None = None):
        """This rank's part of `full` (a tensor of parameter `index`'s full shape), shaped as its
        local tensor: a view where the layout allows."""
        slot, rank = self.slots[index], self.rank if rank is None else rank
        if self.kind == "flat":
            start, end = self.param_range(index, rank)
            return full.reshape(-1)[start:end]
        first = min(rank * slot.chunk_rows, slot.shape[slot.dim])
        return full.narrow(slot.dim, first, self.local_rows(index, rank))

    # ---- where rank r's data of a parameter sits in a group's rank-major block ------------------
    def rank_major_pieces(self, group: GroupLayout) -> list[tuple[int, int, int, int, int]]:
        """(slot index, rank, offset in the group's W * Q block, element count, offset in the
        flattened parameter) of every non-empty piece: one per rank, or per rank and outer
        block for a parameter sharded along a later dim."""
        pieces = []
        q = group.shard_numel
        for index in group.slots:
            slot = self.slots[index]
            for rank in range(self.world_size):
                start, end = self.local_range(index, rank)
                if end <= start:
                    continue
                if self.contiguous(index):
                    pieces.append((index, rank, rank * q + start - group.shard_offset,
                                   end - start, self.param_range(index, rank)[0]))
                    continue
                count = self.local_rows(index, rank) * slot.row_numel
                first = rank * slot.chunk_rows * slot.row_numel
                block = slot.shape[slot.dim] * slot.row_numel
                for o in range(slot.outer):
                    pieces.append((index, rank, rank * q + start - group.shard_offset + o * count,
                                   count, o * block + first))
        return pieces


def flat_layout(shapes: list[tuple[int, ...]], world_size: int, rank: int) -> BucketLayout:
    """FSDP1's flat layout (see the module docstring)."""
    slots, offset = [], 0
    for shape in shapes:
        start = round_up(offset, ALIGN)
        slots.append(SlotLayout(tuple(shape), shard_offset=start, full_offset=start))
        offset = start + math.prod(shape)
    numel_padded = round_up(max(offset, 1), world_size)
    shard = numel_padded // world_size
    layout = BucketLayout("flat", world_size, rank, slots, shard_numel=shard,
                          full_numel=numel_padded)
    layout.groups = [GroupLayout(list(range(len(slots))), 0, shard, 0)]
    return layout


def rows_layout(shapes: list[tuple[int, ...]], world_size: int, rank: int,
                direct_min_numel: int, dims: list[int] | None = None) -> BucketLayout:
    """FSDP2's per-parameter Shard(dim) layout (`dims`: each parameter's, default 0). Parameters
    of at least `direct_min_numel` elements whose rank-major gather is the parameter itself
    (sharded along the first dim with more than one element) are gathered directly (one group
    each), the others together in one copied group."""
    slots = []
    for shape, dim in zip(shapes, dims or [0] * len(shapes)):
        if not 0 <= dim < len(shape):
            raise ValueError(f"a parameter of shape {list(shape)} cannot be sharded along dim {dim}")
        slots.append(SlotLayout(tuple(shape), 0, chunk_rows=math.ceil(shape[dim] / world_size),
                                dim=dim))
    direct = [i for i, s in enumerate(slots)
              if s.numel >= direct_min_numel and s.numel > 0 and s.outer == 1]
    copied = [i for i in range(len(slots)) if i not in direct]
    layout = BucketLayout("rows", world_size, rank, slots)
    shard_offset = full_offset = 0
    for index in direct:
        # Q is exactly the padded chunk, so that the gathered block is the parameter (tail-padded);
        # groups start ALIGN-aligned, in the shard and in the gathered buffer.
        slot = slots[index]
        q = slot.chunk_rows * slot.row_numel  # (outer is 1)
        slot.shard_offset, slot.full_offset = shard_offset, full_offset
        layout.groups.append(GroupLayout([index], shard_offset, q, full_offset))
        shard_offset = round_up(shard_offset + q, ALIGN)
        full_offset = round_up(full_offset + world_size * q, ALIGN)
    if copied:
        start = shard_offset
        for index in copied:
            slot = slots[index]
            slot.shard_offset, slot.full_offset = shard_offset, full_offset
            shard_offset = round_up(shard_offset + slot.outer * slot.chunk_rows * slot.row_numel,
                                    ALIGN)
            full_offset = round_up(full_offset + slot.numel, ALIGN)
        layout.groups.append(GroupLayout(copied, start, shard_offset - start, None))
    layout.shard_numel, layout.full_numel = shard_offset, full_offset
    return layout
