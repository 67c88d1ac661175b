"""The collectives of a CommPolicy (comm_policy.py): block-quantized all-gather of parameters and
all-to-all reduction of gradients. The byte layout of a rank's slot and the arithmetic are the
ops' (ops/reference.py, "block-quantized collectives").

    weights:   per gather group, this rank's region of its shard quantized into its slot of a
               [W * B] byte buffer (B = ops.slot_bytes(Q, block)); one all-gather of bytes; at the
               wait every slot dequantized into the group's target (the same target the exact
               path fills: a slice of the gathered buffer, or a copied group's staging)
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


@dataclass(eq=False)
class QuantizedGather:
    """One gather group's quantized all-gather: `wire` is gathered, `target` filled at `finish`."""

    target: torch.Tensor       # [W * Q], the parameters' dtype
    wire: torch.Tensor         # [W * B] bytes
    world: int
    block: int
    fmt: str

    def finish(self) -> torch.Tensor:
        ops.dequantize_slots(self.wire, self.target, self.world, self.block, self.fmt)
        return self.target


def quantize_for_gather(targets: list[torch.Tensor], sources: list[torch.Tensor], slot: int,
                        world: int, policy) -> list[QuantizedGather]:
    """Per group, a byte buffer with this rank's slot quantized from its source."""
    out = []
    for target, source in zip(targets, sources):
        wire = torch.empty(world * ops.slot_bytes(source.numel(), policy.block_size),
                           dtype=torch.uint8, device=target.device)
        ops.quantize_into_slot(source, wire, slot, policy.block_size, policy.param_gather)
        out.append(QuantizedGather(target, wire, world, policy.block_size, policy.param_gather))
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


def reduce_scatter_quantized(flat: torch.Tensor, layout, group, async_op: bool, policy):
    """comm.reduce_scatter_groups with int8 on the wire: (this rank's region of every group, in
    `flat`, valid once the works are waited for; the works)."""
    world, rank, block = layout.world_size, layout.rank, policy.block_size
    pieces, works = [], []
    for g in layout.groups:
        q = g.shard_numel
        packed = flat.narrow(0, world * g.shard_offset, world * q)
        piece = packed.narrow(0, rank * q, q)
        pieces.append(piece)
        if not q:
            continue
        nbytes = ops.slot_bytes(q, block)
        send = torch.empty(world * nbytes, dtype=torch.uint8, device=flat.device)
        for r in range(world):
            ops.quantize_into_slot(packed.narrow(0, r * q, q), send, r, block, "int8")
        received = torch.empty_like(send)
        work = dist.all_to_all_single(received, send, group=group, async_op=True)

        def finish(received=received, piece=piece, send=send):  # (send: held until done)
            ops.dequantize_sum(received, piece, world, block, "int8")
        handle = _DequantizeAfter(work, finish)
        if not async_op:
            handle.wait()
        works.append(handle)
    return pieces, works
