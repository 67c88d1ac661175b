"""The gradient path of one bucket: pack -> reduce-scatter (-> all-reduce) -> epilogue.

    pack:      the unit's per-parameter gradients go straight into one flat, padded buffer in
               `reduce_dtype`, pre-divided, in a single pass (parameters without a gradient and the
               padding become zeros); no autograd concatenation, no separate cast
    collective: reduce-scatter over the shard group (SUM), then all-reduce over replicas (HSDP)
    epilogue:  post-divide, cast to the sharded gradient's dtype and accumulate in one pass

Under `set_requires_gradient_sync(False)` (no_sync) the packed, pre-divided gradient is added to
an unsharded accumulator in `reduce_dtype` instead, and goes out with the next synchronised step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import ops
from . import comm, finite, storage_cache
from .flat_param import Bucket
from .mixed_precision import divide_factors
from .offload import copy_to_host, to_host
from .trace import RECORDER, profiler_range, span


@dataclass
class BucketGrads:
    """Per-bucket gradient state that lives across micro-batches."""

    unsharded_accumulator: torch.Tensor | None = None   # [numel_padded] reduce dtype, no_sync
    used: list[bool] = field(default_factory=list)      # got a gradient since the last sync
    nonfinite: torch.Tensor | None = None                # check_finite_grads: flags since sync


def pack_grads(bucket: Bucket, grads, reduce_dtype: torch.dtype, pre: float,
               device: torch.device) -> torch.Tensor:
    """One flat [numel_padded] buffer of `grads` (None -> zeros), cast and divided by `pre`."""
    present = [(g.contiguous(), slot.offset) for g, slot in zip(grads, bucket.slots) if g is not None]
    flat = storage_cache.empty(bucket.numel_padded, reduce_dtype, device)
    ops.pack([g for g, _ in present], [o for _, o in present], flat, 0, 1.0 / pre)
    return flat


def reduce_bucket(unit, index: int, grads) -> None:
    """Handle the gradients of bucket `index` from one backward use of `unit`."""
    bucket, state, groups = unit.buckets[index], unit.bucket_grads[index], unit.groups
    used = [g is not None for g in grads]
    state.used = [a or b for a, b in zip(state.used, used)] if state.used else used
    reduce_dtype = unit.mp.reduce_dtype or unit.full[index].dtype
    pre, post = divide_factors(groups.data_parallel_size)
    device = unit.full[index].device
    if unit.options.get("check_finite_grads"):  # off by default: no cost beyond this lookup
        state.nonfinite = finite.merge_flags(state.nonfinite, grads, device)

    if not unit.requires_gradient_sync:
        flat = pack_grads(bucket, grads, reduce_dtype, pre, device)
        if state.unsharded_accumulator is None:
            state.unsharded_accumulator = flat
        else:
            state.unsharded_accumulator.add_(flat)
        return

    result = {}
    accumulator, state.unsharded_accumulator = state.unsharded_accumulator, None
    side = unit.schedule.streams.side
    offload_on_stream = side and unit.offload is not None

    def collectives(async_op: bool) -> list:
        with profiler_range("pack_grads", unit.name):
            flat = pack_grads(bucket, grads, reduce_dtype, pre, device)
        if accumulator is not None:
            flat.add_(accumulator)
        if groups.shard is None:
            output, works = flat, []
        else:
            # With replicas the all-reduce must follow the reduce-scatter: on CPU that means a
            # blocking reduce-scatter and an asynchronous all-reduce.
            output, work = comm.reduce_scatter_into(flat, bucket.shard_numel, groups.shard_rank,
                                                    groups.shard,
                                                    async_op and groups.replicate is None)
            works = [work]
        if groups.replicate is not None:
            works = [comm.all_reduce_sum(output, groups.replicate, async_op)]
        if offload_on_stream:  # queued after the collective on this stream; the host waits for it
            output = copy_to_host(output)
        result.update(output=output, flat=flat)
        return works

    checker = unit.schedule.checker
    checker.check(groups.shard, "reduce_scatter", unit.name, index, bucket.numel_padded, reduce_dtype)
    checker.check(groups.replicate, "all_reduce", unit.name, index, bucket.shard_numel, reduce_dtype)
    unit.schedule.make_room_for_reduce_scatter()  # free finished buffers before packing anew
    RECORDER.add("reduce_scatter.issue", unit.name)
    with profiler_range("reduce_scatter", unit.name):
        pending = unit.schedule.streams.launch(
            "reduce_scatter", collectives, keep_alive=[],
            label=f"reduce_scatter of unit '{unit.name or '<root>'}' bucket {index}")
    RECORDER.add("reduce_scatter.issued", unit.name)  # launched: gradients packed, collective queued
    # With side streams the pack runs on the reduce-scatter stream, so the gradients and the no_sync
    # accumulator it reads (allocated by the compute stream) are held until the compute stream has
    # waited for it (streams.py). Without, the pack already ran, and dropping the gradients now
    # frees a unit's gradients per pending reduce-scatter.
    kept = [*grads, accumulator] if side else []
    pending.keep_alive.extend([result["flat"], *(t for t in kept if t is not None)])
    used_now, state.used = state.used, []
    nonfinite, state.nonfinite = state.nonfinite, None

    def finish() -> None:
        with span("reduce_scatter.wait", unit.name):
            pending.wait(host=offload_on_stream)  # the host epilogue reads the copy to the host
        if nonfinite is not None:
            finite.raise_if_nonfinite(unit, index, nonfinite)
        reduced = result["output"]
        if unit.offload is not None and not side:
            reduced = to_host(reduced)
        accumulate = bucket.sync_param_grads_into_buffer()
        with profiler_range("grad_epilogue", unit.name):
            ops.grad_epilogue(reduced, bucket.grad_shard, 1.0 / post, accumulate)
        storage_cache.recycle(result["flat"])  # nothing reads the packed buffer any more
        result.clear()  # the packed buffer can go now, not when this closure is dropped
        for slot, view, was_used in zip(bucket.slots, bucket.grad_views, used_now):
            # A parameter no rank used keeps grad=None, so optimizers skip it as without sharding.
            if slot.param.grad is None and not was_used and not view.any():
                continue
            slot.param.grad = view

    finish.pending = pending  # what Schedule.abandon_backward waits for without applying
    unit.schedule.add_pending_reduce_scatter(finish)
