"""The collectives of a CommPolicy (comm_policy.py): block-quantized all-gather of parameters and
all-to-all reduction of gradients. The byte layout of a rank's slot and the arithmetic are the
ops' (ops/reference.py, "block-quantized collectives").

    blocks:    a rank's region of a gather group is quantized in blocks of at most `block_size`
               values that never span two parameters (block_starts): one scale per block, so a
               LayerNorm's small values do not share a scale with a large neighbour's
    weights:   per gather group, this rank's region of its shard quantized into its slot of a
               [W * B] byte buffer (B: the group's slot stride, the largest slot of any rank);
               one all-gather of bytes; at the wait every slot dequantized into the group's
               target (the same target the exact path fills: a slice of the gathered buffer, or
               a copied group's staging)
    gradients: per gather group, the packed [W * Q] block quantized rank chunk by rank chunk into
               [W * B] bytes; one all-to-all (rank r receives every rank's chunk r); at the wait
               the W received slots dequantized and summed in fp32 into this rank's region of
               the packed buffer (where the exact path's reduction leaves it)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import ops
from . import streams


def block_starts(layout, group, rank: int, block: int) -> list[int]:
    """Where the blocks of `rank`'s region of gather group `group` (Q values) start: at 0, at
    every parameter's piece, and every `block` values within a piece (the padding after a piece
    is its last block's), so that no scale spans two parameters."""
    q = group.shard_numel
    cuts = {0}
    for index in group.slots:
        start, end = layout.local_range(index, rank)
        if end > start:
            cuts.add(start - group.shard_offset)
    cuts = sorted(c for c in cuts if c < q)
    starts = []
    for begin, end in zip(cuts, cuts[1:] + [q]):
        starts.extend(range(begin, end, block))
    return starts


class _Starts:
    """Per bucket: each (group, rank)'s block starts as an int64 tensor on the device, made once,
    and the group's stride: the largest slot over the ranks, so that every rank's slot has the
    same size. All of a bucket's starts travel in one copy from pinned host memory that does not
    block the host (on a GPU: the first step's only copy for them, where one per group and rank
    was a blocking pageable copy each); the host buffer is kept with them, so the copy may read
    it whenever it runs."""

    def __init__(self, layout, block: int, device: torch.device):
        per_group = [[block_starts(layout, g, r, block) for r in range(layout.world_size)]
                     for g in layout.groups]
        values = [v for ranks in per_group for starts in ranks for v in starts]
        self._host = streams.host_tensor(values, torch.int64, pin=streams.side_streams(device))
        flat = self._host.to(device, non_blocking=True)
        self.tensors, self.strides = [], []
        offset = 0
        for ranks, g in zip(per_group, layout.groups):
            views = []
            for starts in ranks:
                views.append(flat.narrow(0, offset, len(starts)))
                offset += len(starts)
            self.tensors.append(views)
            self.strides.append(max(ops.slot_bytes(g.shard_numel, len(s)) for s in ranks))


def _starts_of(bucket, block: int, device: torch.device) -> _Starts:
    found = getattr(bucket, "_quant_starts", None)
    if found is None or found[0] != (block, device):
        found = ((block, device), _Starts(bucket.layout, block, device))
        bucket._quant_starts = found
    return found[1]


@dataclass(eq=False)
class QuantizedGather:
    """One gather group's quantized all-gather: `wire` is gathered, `target` filled at `finish`."""

    target: torch.Tensor       # [W * Q], the parameters' dtype
    wire: torch.Tensor         # [W * stride] bytes
    stride: int
    starts: list               # per rank, its blocks' starts (int64 tensors)
    fmt: str

    def finish(self) -> torch.Tensor:
        world = len(self.starts)
        q = self.target.numel() // world
        for r, starts in enumerate(self.starts):
            ops.dequantize_from(self.wire.narrow(0, r * self.stride, self.stride),
                                self.target.narrow(0, r * q, q), starts, self.fmt)
        return self.target


def quantize_for_gather(bucket, targets: list[torch.Tensor], sources: list[torch.Tensor],
                        slot: int, world: int, policy) -> list[QuantizedGather]:
    """Per group, a byte buffer with this rank's slot quantized from its source."""
    out = []
    for gi, (target, source) in enumerate(zip(targets, sources)):
        layout = _starts_of(bucket, policy.block_size, target.device)
        stride, starts = layout.strides[gi], layout.tensors[gi]
        wire = torch.empty(world * stride, dtype=torch.uint8, device=target.device)
        ops.quantize_into(source, wire.narrow(0, slot * stride, stride), starts[slot],
                          policy.param_gather)
        out.append(QuantizedGather(target, wire, stride, starts, policy.param_gather))
    return out

class _DequantizeAfter:
    """A work handle whose wait also turns the received bytes into this rank's reduced sums."""

    def __init__(self, work, finish):
        self.work, self._finish = work, finish

    def wait(self, timeout=None) -> bool:
        if self.work is not None:
            if timeout is None:
                self.work.wait()
            else:
                self.work.wait(timeout)
            self.work = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


def reduce_scatter_quantized(flat: torch.Tensor, bucket, group, async_op: bool, policy):
    """comm.reduce_scatter_groups with int8 on the wire: (this rank's region of every group, in
    `flat`, valid once the works are waited for; the works)."""
    layout = bucket.layout
    world, rank = layout.world_size, layout.rank
    blocks = _starts_of(bucket, policy.block_size, flat.device)
    pieces, works = [], []
    for gi, g in enumerate(layout.groups):
        q = g.shard_numel
        packed = flat.narrow(0, world * g.shard_offset, world * q)
        piece = packed.narrow(0, rank * q, q)
        pieces.append(piece)
        if not q:
            continue
        stride, starts = blocks.strides[gi], blocks.tensors[gi]
        send = torch.empty(world * stride, dtype=torch.uint8, device=flat.device)
        for r in range(world):  # chunk r goes to rank r: its region, in its blocks
            ops.quantize_into(packed.narrow(0, r * q, q), send.narrow(0, r * stride, stride),
                              starts[r], "int8")
        received = torch.empty_like(send)
        work = dist.all_to_all_single(received, send, group=group, async_op=True)

        def finish(received=received, piece=piece, send=send, stride=stride,
                   mine=starts[rank]):  # (bound now: this group's; `send` held until done)
            ops.dequantize_sum(received, piece, mine, world, stride, "int8")
        handle = _DequantizeAfter(work, finish)
        if not async_op:
            handle.wait()
        works.append(handle)
    return pieces, works
