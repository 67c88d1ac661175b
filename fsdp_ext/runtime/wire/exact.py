"""Wire formats: what a bucket puts on the wire and how it comes back, one class per kind.

    ExactWire      (this file) the parameters' own values: cast into this rank's slot of each
                   gather group's buffer, all-gathered, copied out where a group is staged;
                   gradients packed, reduce-scattered and accumulated by the epilogue
    QuantizedWire  (wire_quantized.py) a CommPolicy's: block-quantized bytes gathered and
                   dequantized; gradients quantized and exchanged all-to-all, or reduced in bf16
    SubclassWire   (wire_subclass.py) tensor-subclass parameters: the bytes their
                   fsdp_pre_all_gather hooks give, rebuilt by their post-hooks

A bucket's wire format is chosen when its unit is built (param_buckets.py: subclass parameters
or not) and, once the unit's CommPolicy is known (its root's first forward), replaced by the
policy's (`wire_quantized.with_policy`). The runtime's gather path (gather.py) and reduce path (grads.py) are
the same for every format: they ask the bucket's wire what to send and how to finish, and never
which kind it is. Every collective still goes through comm.py.

Alternatives considered: a subclass of Bucket per kind (what the subclass bucket was): the
policy is known only after construction, and the bucket's own state (shard, views, gradients)
is the same for every kind; a strategy object the bucket owns keeps one bucket class.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import ops
from ..comm import collectives as comm
from ..placement import dtensor_params
from ..core import storage_cache


@dataclass(eq=False)
class GatherBuffers:
    """One bucket's part of an all-gather: per collective, the buffer it fills (`targets`) and
    this rank's contribution (`sources`, a slot of its target where already filled in place);
    `done` is what the bucket's wire takes at `finish_gather`."""

    targets: list[torch.Tensor]
    sources: list[torch.Tensor]
    done: object


class ExactWire:
    """The parameters' own values on the wire (param_dtype where mixed precision asks for it)."""

    kind = "exact"
    caches_views = True      # the gathered buffer is refilled in place: views made once stay valid
    takes_comm_policy = True  # a CommPolicy may replace it (wire_quantized.with_policy)

    def describe(self, bucket) -> str:
        if bucket.layout.kind != "rows":
            return "flat"
        if any(s.dim for s in bucket.layout.slots):
            return "DTensor rows, Shard(0) unless marked"
        return "DTensor Shard(0) rows"

    # ---- sharded state ------------------------------------------------------------------------
    def init_shard(self, bucket, device: torch.device, offload) -> None:
        """Allocate the shard and fill it with this rank's part of the parameters. Rows layout:
        parameters on the meta device stay there (their shard too) until `to_empty`; the others
        become DTensor parameters over the shard."""
        meta = bucket.layout.kind == "rows" and any(s.param.is_meta for s in bucket.slots)
        shard = (torch.empty(bucket.shard_numel, dtype=bucket.dtype, device="meta") if meta
                 else bucket.new_shard(device, offload))
        sources_ = [dtensor_params.local_of(slot.param) for slot in bucket.slots]
        if bucket.distributed:
            bucket.become_dtensors(bucket.local_views(shard))
        bucket.init_shard(shard, sources_)

    def gathered_numel(self, bucket) -> int:
        return bucket.full_numel

    def new_grad_shard(self, bucket) -> torch.Tensor:
        """Zeros like the shard (pinned like an offloaded shard, whose grads stay on the host)."""
        return torch.zeros_like(bucket.shard, pin_memory=bucket.shard.is_pinned())

    def sharded_bytes(self, bucket) -> int:
        return bucket.shard_numel * bucket.shard.element_size() if bucket.shard is not None else 0

    def on_meta(self, bucket) -> bool:
        return bucket.shard.is_meta

    def adopt(self, bucket, locals_: list[torch.Tensor]) -> None:
        bucket.copy_into_shard(locals_)

    def local_moved(self, local: torch.Tensor, view: torch.Tensor) -> bool:
        """Whether a parameter's local tensor no longer views its part of the shard."""
        return local.shape != view.shape or (local.data_ptr() != view.data_ptr()
                                             and not view.is_meta)

    # ---- gather -------------------------------------------------------------------------------
    def gather_buffers(self, bucket, full: torch.Tensor, chunks, slot: int, world: int, group,
                       shard: torch.Tensor) -> GatherBuffers:
        """What `bucket` sends in one all-gather into `full` (its storage filled): per group,
        this rank's region of `shard`, or its post-forward `chunks`, cast into `slot`."""
        out = targets(bucket, full, world)
        return GatherBuffers(out, chunks if chunks is not None else sources(bucket, shard), out)

    def finish_gather(self, bucket, full: torch.Tensor, done) -> None:
        """After the collectives: copy the staged groups out into `full`."""
        copy_out(bucket, full, done)

    def full_views(self, bucket, full: torch.Tensor) -> list[torch.Tensor]:
        return bucket.buffer_views(full)

    def release(self, bucket) -> None:
        """Free what this format holds besides the gathered buffer (nothing)."""

    def holds_memory(self, bucket) -> bool:
        return False

    def gather_full(self, bucket, groups, local: torch.Tensor,
                    parameters: bool = False) -> list[torch.Tensor]:
        """All-gather a shard-shaped tensor `local` (on the collective's device: the caller
        moves an offloaded shard) in its own dtype, blocking (state dicts, summon_full_params):
        the full-shape tensors, views of one buffer. `parameters`: `local` is the parameters'
        shard."""
        full = torch.empty(bucket.full_numel, dtype=local.dtype, device=local.device)
        out = targets(bucket, full, groups.shard_size)
        copy_in_and_gather(out, sources(bucket, local), groups.shard_rank, groups.shard,
                           async_op=False)
        copy_out(bucket, full, out)
        return bucket.buffer_views(full)

    def load_value(self, bucket, index: int, value, key: str, local_part):
        """load_state_dict: this rank's part of `value` (a full tensor or a ShardedTensor) for
        parameter `index`, flattened, which the caller packs into the shard (`local_part` cuts
        it; raises ValueError naming `key`)."""
        return local_part(bucket, index, value, key)

    def bind_unit(self, bucket, mesh, mp_policy, offload, post_forward_size: int,
                  unit_type: str) -> None:
        """What the unit's options give this format (nothing, for exact values)."""

    # ---- gradients ----------------------------------------------------------------------------
    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients are packed and reduced in (`dtype`: mixed precision's)."""
        return dtype

    def reduce(self, flat: torch.Tensor, bucket, group, async_op: bool,
               sent: list[int] | None = None):
        """Sum the packed gradients over `group`: (this rank's region of each group, works);
        `sent`: of those gather groups only (grads.groups_sent; None: all)."""
        return comm.reduce_scatter_groups(flat, bucket.layout, group, async_op, sent)


def targets(bucket, full: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Per group, the buffer its collective fills (staging allocated here for copied groups)."""
    out = []
    for g in bucket.layout.groups:
        if g.copied:
            out.append(storage_cache.empty(world * g.shard_numel, full.dtype, full.device))
        else:
            out.append(full.narrow(0, g.full_offset, world * g.shard_numel))
    return out


def sources(bucket, shard: torch.Tensor) -> list[torch.Tensor]:
    """Per group, its region of a shard-shaped tensor (what this rank contributes)."""
    return [shard.narrow(0, g.shard_offset, g.shard_numel) for g in bucket.layout.groups]


def copy_in_and_gather(targets_: list[torch.Tensor], sources_: list[torch.Tensor], slot: int,
                       group, async_op: bool) -> list:
    """Cast each source into its slot of its target (unless it is that slot already: bytes a
    wire format wrote in place), then gather the other slots over `group`."""
    works = []
    for target, source in zip(targets_, sources_):
        if not target.numel():
            continue
        if source.data_ptr() == target.narrow(0, slot * source.numel(), 1).data_ptr():
            pass  # already in its slot
        elif target.dtype in ops.checks.FLOAT_DTYPES:
            ops.cast_into_slot(source, target, slot)
        else:  # (optimizer state of another dtype, gathered for a full state dict)
            target.narrow(0, slot * source.numel(), source.numel()).copy_(source)
        if group is not None:
            slot_view = target.narrow(0, slot * source.numel(), source.numel())
            works.append(comm.all_gather_into(target, slot_view, group, async_op))
    return works


def copy_out(bucket, full: torch.Tensor, targets_: list[torch.Tensor]) -> None:
    """Unpack the copied group's staging (a bucket has at most one copied group) into its
    parameters' places in `full`, one launch, then give the staging back."""
    for g, staging in zip(bucket.layout.groups, targets_):
        if not g.copied:
            continue
        offsets, outs = [], []
        for index, rank, offset, count, start in bucket.layout.rank_major_pieces(g):
            outs.append(full.narrow(0, bucket.layout.slots[index].full_offset + start, count))
            offsets.append(offset)
        if outs and staging.dtype in ops.checks.FLOAT_DTYPES:
            ops.unpack(staging, 0, offsets, outs)
        else:
            for out, offset in zip(outs, offsets):
                out.copy_(staging.narrow(0, offset, out.numel()))
        storage_cache.recycle(staging)
