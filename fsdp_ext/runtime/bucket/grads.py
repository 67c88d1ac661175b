"""The gradient path of one bucket: pack -> reduce-scatter (-> all-reduce) -> epilogue.

    pack:      the unit's per-parameter gradients go straight into one flat buffer of W * S
               elements in `reduce_dtype`, pre-divided, in a single pass (parameters without a
               gradient and the padding become zeros), group by group in the rank-major order of
               layout.py; no autograd concatenation, no separate cast
    collective: reduce-scatter of each group's block over the shard group (SUM), leaving this
               rank its shard region; then all-reduce over replicas (HSDP)
    epilogue:  post-divide (a division in the reduce dtype, as torch's FSDP2 divides: a multiply by
               the reciprocal rounds differently unless the divisor is a power of two), cast to
               the sharded gradient's dtype and accumulate, per group

Under `set_requires_gradient_sync(False)` (no_sync) the packed, pre-divided gradient is added to
an unsharded accumulator in `reduce_dtype` instead, and goes out with the next synchronised step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import ops
from ..comm import collectives as comm
from . import finite
from ..core import storage_cache
from .bucket import Bucket
from ..core.mixed_precision import divide_factors
from ..core.offload import copy_to_host, to_host
from ..core.trace import RECORDER, profiler_range, span


def pack_grads(bucket: Bucket, grads, reduce_dtype: torch.dtype, pre: float,
               device: torch.device, sent: list[int] | None = None) -> torch.Tensor:
    """One flat [W * S] buffer of `grads` (None -> zeros), cast and divided by `pre`: group g's
    block at W * g.shard_offset in rank-major order (a direct group's parameters at their place
    in the gathered order, a copied group's cut into each rank's rows). `sent`: only those
    groups' blocks are written (None: all)."""
    layout = bucket.layout
    srcs, offsets = [], []
    for g in _groups(layout, sent):
        base = layout.world_size * g.shard_offset
        if not g.copied:
            for index in g.slots:
                if grads[index] is not None:
                    srcs.append(grads[index].contiguous())
                    offsets.append(base + layout.slots[index].full_offset - g.full_offset)
            continue
        for index, rank, offset, count, start in layout.rank_major_pieces(g):
            if grads[index] is not None:
                srcs.append(grads[index].contiguous().view(-1).narrow(0, start, count))
                offsets.append(base + offset)
    flat = storage_cache.empty(layout.world_size * layout.shard_numel, reduce_dtype, device)
    ops.pack(srcs, offsets, flat, 0, 1.0 / pre)
    return flat


def reduce_bucket(unit, bucket: Bucket, grads, ran: list[bool] | None = None) -> None:
    """Handle the gradients of `bucket` (one of `unit`'s) from one backward use of `unit`
    (`ran`: per parameter, whether its module ran in that use; None: all did)."""
    groups = bucket.groups  # its unit's, or its own mesh's (placement/)
    reduce_group = groups.reduce_scatter_over(unit.separate_reduce_scatter)
    bucket.grads.note_used([g is not None for g in grads])
    bucket.grads.note_ran(ran if ran is not None else [True] * len(grads))
    # What goes on the wire is the bucket's wire format's (a CommPolicy may reduce in bf16).
    reduce_dtype = bucket.wire.reduce_dtype(unit.mp.reduce_dtype or bucket.full.dtype)
    pre, post = divide_factors(groups.data_parallel_size, unit.gradient_divide_factor)
    device = bucket.full.device
    if unit.config.check_finite_grads:  # off by default: no cost beyond this lookup
        bucket.grads.merge_nonfinite(finite.merge_flags(bucket.grads.nonfinite, grads, device))

    if not unit.requires_gradient_sync:
        bucket.grads.accumulate_unsharded(pack_grads(bucket, grads, reduce_dtype, pre, device))
        return

    accumulator, partial, used, nonfinite, ran = bucket.grads.take_for_sync()
    side = unit.schedule.streams.side
    all_reduce = groups.replicate is not None and unit.requires_all_reduce
    keep_partial = groups.replicate is not None and not unit.requires_all_reduce
    sent = None
    if partial is None and not keep_partial and unit.all_reduce_hook is None:
        sent = groups_sent(bucket.layout, used, ran)
        if sent == []:  # no member holding these parameters ran since the last sync
            return
    record = PendingReduce(unit, bucket, keep_partial=keep_partial, divisor=post, used=used,
                           nonfinite=nonfinite, sent=sent,
                           offload_on_stream=side and unit.offload is not None and not keep_partial)

    def collectives(async_op: bool) -> list:
        with profiler_range("pack_grads", unit.name):
            flat = pack_grads(bucket, grads, reduce_dtype, pre, device, sent)
        if accumulator is not None:
            flat.add_(accumulator)
        # With replicas the all-reduce must follow the reduce-scatter: on CPU that means a
        # blocking reduce-scatter and an asynchronous all-reduce.
        blocking = not async_op or groups.replicate is not None
        pieces, works = bucket.wire.reduce(flat, bucket, reduce_group, not blocking, sent)
        if partial is not None:  # on the collective's stream, after the reduce-scatter
            for piece, earlier in zip(pieces, partial):
                piece.add_(earlier)
        kept = None
        if keep_partial:  # its own copy: the packed buffer is recycled
            kept = [p.clone() for p in pieces]
        elif all_reduce:
            works = [comm.all_reduce_sum(p, groups.replicate, async_op) for p in pieces]
        if record.offload_on_stream:  # queued after the collective on this stream
            pieces = [copy_to_host(p) for p in pieces]
        record.launched(flat, pieces, kept)
        return [w for w in works if w is not None]

    checker = unit.schedule.checker

    def tags() -> list:
        issued = [checker.issue(reduce_group, "reduce_scatter", unit.name,
                                [(flat_numel(bucket, sent), reduce_dtype)], "backward")]
        if all_reduce:
            issued.append(checker.issue(groups.replicate, "all_reduce", unit.name,
                                        [(bucket.shard_numel, reduce_dtype)], "backward"))
        return issued
    unit.schedule.make_room_for_reduce_scatter()  # free finished buffers before packing anew
    RECORDER.add("reduce_scatter.issue", unit.name)
    index = unit.buckets.index(bucket)
    with profiler_range("reduce_scatter", unit.name):
        pending = unit.schedule.streams.launch(
            "reduce_scatter", collectives, keep_alive=[],
            label=f"reduce_scatter of unit '{unit.name or '<root>'}' bucket {index}", tags=tags)
    RECORDER.add("reduce_scatter.issued", unit.name)  # launched: gradients packed, collective queued
    # With side streams the pack runs on the reduce-scatter stream, so the gradients and the no_sync
    # accumulator it reads (allocated by the compute stream) are held until the compute stream has
    # waited for it (streams.py). Without, the pack already ran, and dropping the gradients now
    # frees a unit's gradients per pending reduce-scatter.
    kept = [*grads, accumulator, *(partial or ())] if side else []
    record.started(pending, [t for t in kept if t is not None])
    unit.schedule.add_pending_reduce_scatter(record)


def reduce_accumulated(unit) -> bool:
    """Reduce what no_sync backwards left in `unit`'s unsharded accumulators, with no backward
    of its own (torch's pipelining asks for it once every micro-batch ran backward: its
    post_backward()). No-op for buckets without an accumulator; True if anything was issued."""
    issued = False
    for index in unit.params.grad_indices:
        bucket = unit.buckets[index]
        if bucket.grads.unsharded_accumulator is not None:
            reduce_bucket(unit, bucket, [None] * len(bucket.slots))
            issued = True
    return issued


@dataclass(eq=False)
class PendingReduce:
    """One bucket's gradient reduction in flight, from its launch to `finish()` (its results
    reach the gradient shard and `.grad`) or `abandon()` (its collectives are waited for and its
    results dropped: the backward that made them failed). The schedule holds these in issue order
    (Schedule.pending_reduce_scatters); nothing else writes them after the launch."""

    unit: object                 # runtime.unit.Unit (not imported: unit imports this module)
    bucket: Bucket
    keep_partial: bool = False   # HSDP, all-reduce deferred: the sum waits for a later reduction
    divisor: float = 1.0         # post-divide of the reduced sum (mixed_precision.divide_factors)
    offload_on_stream: bool = False  # pieces are host copies, read after the step's host wait
    pending: comm.Pending | None = None
    flat: torch.Tensor | None = None          # the packed buffer (recycled at the end)
    pieces: list[torch.Tensor] = field(default_factory=list)  # this rank's reduced regions
    partial: list[torch.Tensor] | None = None  # keep_partial: their own copies
    used: list[bool] = field(default_factory=list)  # per parameter: got a gradient since sync
    sent: list[int] | None = None              # the gather groups reduced (None: all)
    nonfinite: torch.Tensor | None = None     # check_finite_grads: the flags to exchange

    def launched(self, flat: torch.Tensor, pieces: list[torch.Tensor],
                 partial: list[torch.Tensor] | None) -> None:
        """(From the launch, on the collective's stream.) What the collectives write."""
        self.flat, self.pieces, self.partial = flat, pieces, partial

    def started(self, pending: comm.Pending, keep_alive: list[torch.Tensor]) -> None:
        """The collectives are in flight: `keep_alive` (and the packed buffer) held until done."""
        self.pending = pending
        pending.hold(self.flat, *keep_alive)

    def finish(self) -> None:
        unit, bucket = self.unit, self.bucket
        with span("reduce_scatter.wait", unit.name):
            self.pending.wait()
        if self.nonfinite is not None:
            finite.raise_if_nonfinite(unit, bucket, self.nonfinite)
        if self.keep_partial:  # nothing reaches .grad yet
            bucket.grads.keep_partial(self.partial)
            self._release()
            return
        pieces, divisor = self.pieces, self.divisor
        reduce_dtype = self.flat.dtype
        if unit.all_reduce_hook is not None:
            pieces, divisor = _run_all_reduce_hook(unit.all_reduce_hook, pieces, divisor,
                                                   reduce_dtype)
        if unit.offload is not None and not unit.schedule.streams.side:
            pieces = [to_host(p) for p in pieces]
        if self.offload_on_stream:  # the host reads its copies after the step's one wait
            used = self.used
            sent = self.sent
            unit.schedule.host_reads.after_sync(
                lambda: _epilogue(unit.name, bucket, pieces, divisor, used, sent))
        else:  # (on CPU the pieces are views of the packed buffer: before it is recycled)
            _epilogue(unit.name, bucket, pieces, divisor, self.used, self.sent,
                      unit.schedule.host_reads if unit.schedule.streams.side else None)
        self._release()

    def abandon(self) -> None:
        self.pending.wait()
        self._release()

    def _release(self) -> None:
        if self.flat is not None:
            storage_cache.recycle(self.flat)  # nothing reads the packed buffer any more
        self.flat, self.pieces, self.partial = None, [], None


def _epilogue(unit_name: str, bucket: Bucket, pieces: list[torch.Tensor], divisor: float,
              used: list[bool], sent: list[int] | None, host_reads=None) -> None:
    """Accumulate this rank's reduced shard into the bucket's gradient shard; publish `.grad`.
    `host_reads`: the device's (side streams), where whether another rank used a parameter this
    one did not is read after the step's one host wait."""
    accumulate = bucket.sync_param_grads_into_buffer()
    reduced = _groups(bucket.layout, sent)
    with profiler_range("grad_epilogue", unit_name):
        for g, piece in zip(reduced, pieces):
            ops.grad_epilogue(piece, bucket.grad_shard.narrow(0, g.shard_offset, g.shard_numel),
                              divisor, accumulate)
    unknown = []  # no gradient here: a zero reduced gradient means no rank used the parameter
    for i in (i for g in reduced for i in g.slots):
        if bucket.slots[i].param.grad is None and not used[i]:
            unknown.append(i)
        bucket.publish_grad(i)
    if unknown:
        _unpublish_unused(bucket, unknown, host_reads)


def _unpublish_unused(bucket: Bucket, indices: list[int], host_reads) -> None:
    """A parameter no rank used goes back to grad=None, so optimizers skip it as without
    sharding. Its reduced gradient is tested on the device; with side streams the flags are
    copied to the host and read after the step's one host wait (until then `.grad` is its zero
    gradient, and a later reduction accumulates into it as into any published gradient)."""
    views = bucket.grad_views
    flags = torch.stack([views[i].any() for i in indices])

    def decide(flags: torch.Tensor) -> None:
        for i, any_rank_used in zip(indices, flags.tolist()):
            if not any_rank_used:
                bucket.unpublish_grad(i)
    if host_reads is None:  # (the CPU path: the values are here)
        decide(flags)
    else:
        host = copy_to_host(flags)
        host_reads.after_sync(lambda: decide(host))


def _run_all_reduce_hook(hook, pieces: list[torch.Tensor], post: float,
                         reduce_dtype: torch.dtype) -> tuple[list[torch.Tensor], float]:
    """FSDPModule.set_all_reduce_hook: `hook(reduce_output)` on this rank's reduced shard, one
    contiguous tensor in the reduce dtype, which the hook may change in place. As in torch's FSDP2
    the hook sees the averaged gradient, except with an fp16 reduction, where the sum is divided
    half before and half after (torch likewise), and the hook sees it between the two."""
    output = torch.cat(pieces) if len(pieces) != 1 else pieces[0].clone()
    divisor = post
    if reduce_dtype != torch.float16:
        output.div_(post)
        divisor = 1.0
    hook(output)
    return list(output.split([p.numel() for p in pieces])), divisor


def flat_numel(bucket: Bucket, sent: list[int] | None = None) -> int:
    """Elements of the packed gradient buffer (and of every rank's gathered contribution); with
    `sent`, of those groups' blocks, what a reduction of only them sends."""
    if sent is None:
        return bucket.layout.world_size * bucket.shard_numel
    return bucket.layout.world_size * sum(g.shard_numel for g in _groups(bucket.layout, sent))


def groups_sent(layout, used: list[bool], ran: list[bool]) -> list[int] | None:
    """The gather groups a synchronised reduction sends: those holding a parameter that got a
    gradient or whose module ran since the last sync (None: all of them). A list unit's member
    that ran in no use got no gradient on any rank (the ranks run the same program), so the
    groups of its parameters alone are left out on every rank alike, as torch's FSDP2 leaves out
    parameters without a gradient: torchtitan's chunked loss sends `lm_head` with the chunks and
    `norm` with the decoder's backward, each once. A parameter whose module ran but got no
    gradient may have one on another rank (a branch not taken here): it is sent, as zeros."""
    sent = [gi for gi, g in enumerate(layout.groups) if any(used[i] or ran[i] for i in g.slots)]
    return None if len(sent) == len(layout.groups) else sent


def _groups(layout, sent: list[int] | None) -> list:
    return layout.groups if sent is None else [layout.groups[i] for i in sent]
