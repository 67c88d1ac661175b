"""The wire format of a CommPolicy (comm_policy.py): block-quantized all-gather of parameters and
all-to-all reduction of gradients, or gradients reduced in bf16. The byte layout of a rank's slot
and the arithmetic are the ops' (ops/reference.py, "block-quantized collectives").

    blocks:    a rank's region of a gather group is quantized in blocks of at most `block_size`
               values that never span two parameters, nor a parameter and padding
               (block_starts): one scale per block, so a LayerNorm's small values do not share a
               scale with a large neighbour's, and NaN in the padding stays in the padding
    weights:   per gather group, this rank's region of its shard quantized into its slot of a
               [W * B] byte buffer (B: the group's slot stride, the largest slot of any rank);
               one all-gather of bytes (the gather path every format takes); at the wait every
               slot dequantized into the group's target (the same target the exact path fills:
               a slice of the gathered buffer, or a copied group's staging)
    gradients: per gather group, the packed [W * Q] block quantized rank chunk by rank chunk into
               [W * B] bytes; one all-to-all (rank r receives every rank's chunk r); at the wait
               the W received slots dequantized and summed in fp32 into this rank's region of
               the packed buffer (where the exact path's reduction leaves it)

A regather from post-forward chunks (which hold gathered values) and a local copy (no group)
stay exact, as does everything the policy leaves off (param_gather or grad_reduce None).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import ops
from ..comm import collectives as comm
from ..core import streams
from .exact import ExactWire, GatherBuffers, copy_out, sources, targets


def with_policy(wire, policy):
    """The wire format a bucket runs with under `policy` (None: its own)."""
    if policy is None or not wire.takes_comm_policy:
        return wire
    return QuantizedWire(policy)


def block_starts(layout, group, rank: int, block: int) -> list[int]:
    """Where the blocks of `rank`'s region of gather group `group` (Q values) start: at 0, where
    every parameter's piece starts and ends, and every `block` values within a piece or a run of
    padding. No scale spans two parameters, nor a parameter and padding: a block's scale comes
    from the values it holds, so whatever the padding holds (NaN, garbage) reaches only the
    padding's own blocks, as the exact path carries it, never a parameter's values."""
    q = group.shard_numel
    cuts = {0}
    for index in group.slots:
        start, end = layout.local_range(index, rank)
        if end > start:
            cuts.update((start - group.shard_offset, end - group.shard_offset))
    cuts = sorted(c for c in cuts if c < q)
    starts = []
    for begin, end in zip(cuts, cuts[1:] + [q]):
        starts.extend(range(begin, end, block))
    return starts


class _Starts:
    """Per bucket: each (group, rank)'s block starts as an int64 tensor on the device, made once,
    and the group's stride: the largest slot over the ranks, so that every rank's slot has the
    same size. All of a bucket's starts travel in one copy from pinned host memory that does not
    block the host (on a GPU: the first step's only copy for them); the host buffer is kept with
    them, so the copy may read it whenever it runs."""

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


@dataclass(eq=False)
class _Dequantize:
    """What a quantized gather's finish takes: its groups' gathers."""

    gathers: list[QuantizedGather]


class QuantizedWire(ExactWire):
    """A CommPolicy's wire format (see the module docstring); exact where the policy is off."""

    kind = "quantized"

    def __init__(self, policy):
        self.policy = policy
        self._starts: dict[tuple, _Starts] = {}  # (bucket, device) -> its block starts

    def _starts_of(self, bucket, device: torch.device) -> _Starts:
        key = (id(bucket), device)
        if key not in self._starts:
            self._starts[key] = _Starts(bucket.layout, self.policy.block_size, device)
        return self._starts[key]

    def gather_buffers(self, bucket, full, chunks, slot, world, group, shard) -> GatherBuffers:
        fmt = self.policy.param_gather
        if fmt is None or chunks is not None or group is None:
            return super().gather_buffers(bucket, full, chunks, slot, world, group, shard)
        layout = self._starts_of(bucket, full.device)
        gathers, mine = [], []  # (this rank's slot of each wire: its source, filled here)
        for gi, (target, source) in enumerate(zip(targets(bucket, full, world),
                                                  sources(bucket, shard))):
            stride, starts = layout.strides[gi], layout.tensors[gi]
            wire = torch.empty(world * stride, dtype=torch.uint8, device=full.device)
            mine.append(wire.narrow(0, slot * stride, stride))
            ops.quantize_into(source, mine[-1], starts[slot], fmt)
            gathers.append(QuantizedGather(target, wire, stride, starts, fmt))
        return GatherBuffers([g.wire for g in gathers], mine, _Dequantize(gathers))

    def finish_gather(self, bucket, full, done) -> None:
        if isinstance(done, _Dequantize):  # (else an exact gather of this bucket)
            done = [g.finish() for g in done.gathers]  # dequantized into the targets
        copy_out(bucket, full, done)

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16 if self.policy.grad_reduce == "bf16" else dtype

    def reduce(self, flat: torch.Tensor, bucket, group, async_op: bool,
               sent: list[int] | None = None):
        if self.policy.grad_reduce != "int8" or group is None:
            return super().reduce(flat, bucket, group, async_op, sent)
        layout = bucket.layout
        world, rank = layout.world_size, layout.rank
        blocks = self._starts_of(bucket, flat.device)
        pieces, works = [], []
        for gi, g in enumerate(layout.groups):
            if sent is not None and gi not in sent:
                continue
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

            def finish(received=received, piece=piece, stride=stride, mine=starts[rank]):
                ops.dequantize_sum(received, piece, mine, world, stride, "int8")
            # (`send` is held by the work until it is waited for)
            works.append(comm.all_to_all_then(received, send, group, async_op, finish))
        return pieces, [w for w in works if w is not None]
