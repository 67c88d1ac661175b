"""One unit: the parameters of one `fully_shard` call, their buckets and the hooks that move them.

The timeline of a unit in one training step (see README, "How it works"):

    pre_forward:   unshard (all-gather every bucket into its `full` buffer), parameters -> views
    post_forward:  parameters -> shard views again; free `full` unless kept for backward
    pre_backward:  (a hook on the forward outputs) unshard again if it was freed
    post_backward: (the backward of the views) pack + reduce-scatter the gradients, free `full`

Each bucket is gathered group by group (gather.py); the parameters are views of the gathered
buffer `full` (layout.py says where each one lies). The views the forward sees come from
`_UnshardedViews`, an autograd function whose backward receives
the per-parameter gradients (None for parameters the forward did not use) and hands them to the
gradient path (`grads.py`) instead of returning them to autograd. Freeing takes
the storage down to zero bytes (`storage_cache.release`, like `untyped_storage().resize_(0)`), which
keeps every view and every tensor autograd saved valid; the refill (`storage_cache.fill`) writes
through `full.data`, an alias with its own version counter, so autograd does not mistake the refill
for an in-place edit of the tensors it saved.
"""
from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .. import ops
from . import comm, dtensor_params, gather, storage_cache, streams
from .deferred_init import materialize_meta_modules
from .grads import BucketGrads, reduce_bucket
from .mixed_precision import MixedPrecisionPolicy, cast_floating
from .offload import CPUOffloadPolicy, to_compute_device
from .schedule_options import ScheduleOptions
from .param_buckets import OWNER_ATTR, build_buckets, init_sharded_state
from .registry import unit_name, unit_of
from .schedule import Schedule
from .trace import RECORDER, begin_range, end_range, profiler_range, span

# fully_shard's default split (layout.py, [Note: gather groups]): parameters of at least this many
# elements are gathered directly, the rest together and copied out. Chosen by measurement:
# docs/benchmarks.md, "Gathering DTensor parameters". The environment variable, or the option
# of shard_module, overrides it (1: every parameter direct; a huge value: every one copied out).
DIRECT_MIN_NUMEL = 1 << 16
DIRECT_MIN_NUMEL_ENV = "FSDP_EXT_DIRECT_MIN_NUMEL"


class _UnshardedViews(torch.autograd.Function):
    """Forward: the parameter views of the unit's trainable buckets. Backward: their gradients go
    to the unit's gradient path; nothing flows back into the flat buffers."""

    @staticmethod
    def forward(ctx, unit: "Unit", *fulls: torch.Tensor):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # unused parameters arrive as None, not zeros
        views = []
        for index, full in zip(unit.grad_bucket_indices, fulls):
            views.extend(unit.buckets[index].full_views(full))
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward(grads)
        return (None,) * (1 + len(ctx.unit.grad_bucket_indices))


class Unit:
    """Args beyond the obvious: `module` is one module, or a list of modules sharded together
    (torch's `fully_shard([m1, m2])`: one all-gather and one reduce-scatter for all of them; the
    pre-forward runs at the first of them to run, the post-forward once all of them ran);
    `layout` "flat" (FullyShardedDataParallel) or "rows" (fully_shard, DTensor parameters on
    `mesh`, else on a mesh made from `groups`); `param_init_fn` materialises
    meta parameters here (the flat layout always does, with reset_parameters() by default; the rows
    layout leaves them on meta until the user's `to_empty`, as torch's fully_shard does);
    `ignored_params` (ids) stay plain parameters of the module, never sharded or reduced."""

    def __init__(self, module: nn.Module | list[nn.Module], groups: comm.Groups,
                 mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool | int | None, options: ScheduleOptions,
                 offload: CPUOffloadPolicy | None = None, param_init_fn=None,
                 layout: str = "flat", mesh=None, ignored_params: set[int] = frozenset(),
                 check_finite_grads: bool = False, direct_min_numel: int | None = None):
        self.members = list(module) if isinstance(module, (list, tuple)) else [module]
        self.module = self.members[0]    # the unit's module (a list's first)
        self.groups = groups
        self.mp = mp
        self.reshard_after_forward = reshard_after_forward  # None: True unless root
        self.options = options           # the schedule's if it becomes the root (schedule_options)
        self.check_finite_grads = check_finite_grads  # flags exchanged per bucket (finite.py)
        self.name = ""                   # fully qualified name, set by the root at lazy init
        self.member_names = [""] * len(self.members)  # each member's, likewise
        self.members_to_run: set[int] = set()  # a list's members yet to run in this forward
        self.schedule: Schedule | None = None
        self.is_root = False
        self.requires_gradient_sync = True
        # torch FSDPModule's set_* knobs (api/fsdp_module.py says what each means)
        self.requires_all_reduce = True      # HSDP: False defers the all-reduce (grads.py)
        self.reshard_after_backward = True   # False: stay unsharded from backward to next forward
        self.unshard_in_backward = True      # False: backward needs none of the parameters
        self.gradient_divide_factor: float | None = None
        self.all_reduce_hook = None          # hook(reduced shard) before the epilogue
        self.forward_prefetch_units: list[Unit] | None = None   # explicit lists replace depth
        self.backward_prefetch_units: list[Unit] | None = None
        self.method_depth = 0                # inside a register_fsdp_forward_method method
        self.params_in_use = False           # the modules hold the gathered parameters
        self.summoned = False                # inside summon_full_params
        self.offload = offload
        if layout == "flat" or param_init_fn is not None:
            materialize_meta_modules([m for member in self.members for m in _owned_modules(member)],
                                     groups.device, param_init_fn)
        self.mesh = (dtensor_params.storage_mesh(mesh, groups.shard, groups.replicate, groups.device)
                     if layout == "rows" else None)
        direct_min_numel = direct_min_numel or int(
            os.environ.get(DIRECT_MIN_NUMEL_ENV, DIRECT_MIN_NUMEL))
        self.buckets = build_buckets(self.members, groups, layout, self.mesh, direct_min_numel,
                                     ignored_params)
        self.full: list[torch.Tensor] = []
        self.full_data: list[torch.Tensor] = []
        self.unsharded = False
        self.pending_unshard: comm.Pending | None = None
        self._unshard_kind = "all_gather"  # what the pending unshard is ("unshard_copy": local)
        self.post_forward_chunks: list[list[torch.Tensor]] | None = None  # per bucket, per group
        self._copy_out_after_wait: list[list[torch.Tensor]] | None = None
        self.pre_backward_done = False
        self.grad_bucket_indices = [i for i, b in enumerate(self.buckets) if b.requires_grad]
        self._no_grad_view_cache: list[tuple[nn.Module, str, torch.Tensor]] | None = None
        self.bucket_grads = [BucketGrads() for _ in self.buckets]
        self._init_sharded_state()
        # The hooks run eagerly under torch.compile (a graph break at each unit boundary, as
        # torch's FSDP2 skips its hooks): they issue collectives and resize storages, which
        # graphs with dynamic shapes cannot hold, and they decide per step what to gather.
        pre, post = ((self._pre_forward, self._post_forward) if len(self.members) == 1
                     else (self._member_pre_forward, self._member_post_forward))
        self._handles = [handle for member in self.members for handle in (
            member.register_forward_pre_hook(torch.compiler.disable(pre), prepend=True,
                                             with_kwargs=True),
            member.register_forward_hook(torch.compiler.disable(post), with_kwargs=True))]
        # Submodules holding this unit's parameters say so when called while they are sharded
        # (outside the unit's forward), instead of failing with a shape error deep in torch.
        holders = {id(m): m for b in self.buckets for s in b.slots for m, _ in s.locations}
        check = torch.compiler.disable(self._check_params_gathered)
        self._handles += [m.register_forward_pre_hook(check) for m in holders.values()
                          if not any(m is member for member in self.members)]

    # ---- set-up -----------------------------------------------------------------------------------
    def _init_sharded_state(self) -> None:
        device = self.groups.device
        init_sharded_state(self.buckets, device, self.offload)
        for bucket in self.buckets:
            dtype = self.mp.param_dtype or bucket.dtype
            full = torch.empty(bucket.full_numel, dtype=dtype, device=device)
            streams.free_storage(full)  # allocated when first gathered
            full.requires_grad_(bucket.requires_grad)
            self.full.append(full)
            self.full_data.append(full.data)

    @property
    def reshards_after_forward(self) -> bool:
        if self.reshard_after_forward is None:
            return not self.is_root
        return bool(self.reshard_after_forward)

    def holds_unsharded_memory(self) -> bool:
        return any(full.untyped_storage().size() > 0 for full in self.full_data)

    @property
    def transient(self) -> bool:
        """Freed between uses, so it counts towards the in-flight bound."""
        return self.reshards_after_forward

    def param_name(self, slot) -> str:
        """A parameter's name in the model (known once the root has named the units)."""
        prefix = self.member_names[slot.member]
        return f"{prefix}.{slot.fqn}" if prefix else slot.fqn

    @property
    def type_name(self) -> str:
        """The class name of the unit's module (of each module, for a list), for messages."""
        return "+".join(type(m).__name__.removeprefix("FSDP") for m in self.members)

    # ---- unshard / reshard -------------------------------------------------------------------------
    def unshard(self, async_op: bool = True) -> None:
        """Issue the all-gathers of every bucket (no-op if unsharded or already in flight)."""
        if self.unsharded or self.pending_unshard is not None:
            return
        chunks, self.post_forward_chunks = self.post_forward_chunks, None
        if not self.buckets:  # every parameter belongs to child units: nothing to gather or wait for
            self.unsharded = True
            return
        self.check_materialized()
        if chunks is not None:  # regather from the smaller post-forward group (W/k ranks' chunks each)
            group, slot = self.groups.post_forward, self.groups.post_forward_rank
        else:
            group, slot = self.groups.shard, self.groups.shard_rank
        schedule = self.schedule or Schedule.create_standalone(self)  # unshard() before forward
        sizes = [(bucket.full_numel, full.dtype) for bucket, full in zip(self.buckets, self.full)]

        def tags():
            return [schedule.checker.issue(group, "all_gather", self.name, sizes,
                                           schedule.phase())]
        # Without a shard group (NO_SHARD, one rank) the unshard is a local copy: the trace says
        # so instead of showing an all-gather that does not happen.
        what = "all_gather" if group is not None else "unshard_copy"
        self._unshard_kind = what
        RECORDER.add(f"{what}.issue", self.name)
        label = f"{what} of unit '{self.name or '<root>'}'"
        with profiler_range(what, self.name):
            if schedule.streams.issue_thread:  # CPU: copy-in and broadcasts off this thread
                targets, sources = [], []
                for i, (bucket, full) in enumerate(zip(self.buckets, self.full_data)):
                    storage_cache.fill(full)
                    targets.append(gather.targets(bucket, full, self.groups.shard_size))
                    sources += chunks[i] if chunks is not None else gather.sources(bucket,
                                                                                   bucket.shard)
                self._copy_out_after_wait = targets
                # The tag goes on `group`, issued by this thread; the data on the issue thread's
                # own group: each group's collectives keep one order on every rank.
                issued = [t.exchange() for t in tags() if t is not None]
                self.pending_unshard = comm.issue_all_gather(
                    [t for ts in targets for t in ts], sources, slot,
                    comm.issue_thread_group(group), label, schedule.streams.timeout)
                self.pending_unshard.tags = issued
            else:
                # With side streams the copy-in reads the post-forward chunks (allocated by the
                # compute stream) on the all-gather stream: they are held until it is waited for.
                self.pending_unshard = schedule.streams.launch(
                    "all_gather",
                    lambda async_op: self._all_gather_fn(chunks, group, slot, async_op),
                    keep_alive=[c for cs in chunks or () for c in cs], label=label,
                    after_event=schedule.take_post_optim_event() if self.is_root else None,
                    tags=tags)
                if self.offload is not None and chunks is None:  # read the host shards
                    schedule.host_read_event = self.pending_unshard.event
        RECORDER.add(f"{what}.issued", self.name)  # launched: collective queued
        schedule.note_unshard(self)
        if not async_op:
            self.wait_unshard()

    def _all_gather_fn(self, chunks, group, slot: int, async_op: bool) -> list:
        """Fill each bucket's `full` buffer, copy this rank's shard (or post-forward chunks) into
        `slot` of every group's target, gather the other slots; copy out at once when the
        collectives are synchronous (side streams: stream order does the rest), else at the wait."""
        works, targets = [], []
        for i, (bucket, full) in enumerate(zip(self.buckets, self.full_data)):
            storage_cache.fill(full)
            if chunks is not None:
                sources = chunks[i]
            else:
                shard = bucket.shard
                if self.offload is not None:
                    shard = to_compute_device(shard, full.device)
                sources = gather.sources(bucket, shard)
            targets.append(gather.targets(bucket, full, self.groups.shard_size))
            with profiler_range("copy_in", self.name):
                works += gather.copy_in_and_gather(targets[-1], sources, slot, group, async_op)
        if async_op:
            self._copy_out_after_wait = targets
        else:
            self._copy_out(targets)
        return works

    def _copy_out(self, targets: list[list[torch.Tensor]]) -> None:
        with profiler_range("copy_out", self.name):
            for bucket, full, bucket_targets in zip(self.buckets, self.full_data, targets):
                gather.copy_out(bucket, full, bucket_targets)

    def check_params_unchanged(self) -> None:
        """Raise, before any collective, if a sharded parameter was replaced since fully_shard.

        The runtime points the module attributes at its own views in every forward, so an assigned
        new Parameter (or a `.data` swapped for a tensor of another shape) would be silently
        dropped, and the optimizer would keep updating a shard the model no longer reads. The check
        costs two identity/pointer comparisons per parameter.
        """
        if self.params_in_use or self.summoned:  # gathered on purpose: full tensors, not shards
            return
        for bucket in self.buckets:
            for slot, view in zip(bucket.slots, bucket.shard_views):
                name = self.param_name(slot)
                for module, attr in slot.locations:
                    if module._parameters.get(attr) is not slot.param:
                        raise RuntimeError(
                            f"parameter '{name}' ({type(module).__name__}.{attr}) was replaced after "
                            "fully_shard: the sharded parameter is no longer the module's attribute. "
                            "Change parameters in place (torch.no_grad() + copy_) or via "
                            "load_state_dict, or make the change before fully_shard")
                local = dtensor_params.local_of(slot.param)
                replaced = local is not slot.param and dtensor_params.data_was_replaced(slot.param)
                if replaced or local.shape != view.shape or (local.data_ptr() != view.data_ptr()
                                                             and not view.is_meta):
                    local = slot.param.data if replaced else local
                    raise RuntimeError(
                        f"parameter '{name}' had its .data replaced after fully_shard (now shape "
                        f"{list(local.shape)}; this rank's shard is {list(view.shape)} of the "
                        f"original {list(slot.shape)}): it no longer views the sharded storage. "
                        "Copy new values in place, or make the change before fully_shard")

    def check_materialized(self) -> None:
        """Raise if parameters are still on the meta device (built under torch.device("meta"),
        sharded, and never given storage)."""
        for bucket in self.buckets:
            if bucket.shard.is_meta:
                raise RuntimeError(
                    f"unit '{self.name or '<root>'}' ({self.type_name}) still has its "
                    f"parameters (e.g. '{bucket.slots[0].fqn}') on the meta device: call "
                    "model.to_empty(device=...) and initialise them (e.g. reset_parameters()) "
                    "before the first forward, as with torch's fully_shard")

    def adopt_params(self) -> None:
        """After nn.Module._apply (`to_empty`, `to`) or `load_state_dict(assign=True)` gave the
        modules new parameters: copy their values into the shard (allocated now if it was on the
        meta device) and make them view it again."""
        device = self.groups.device
        for bucket in self.buckets:
            current = [slot.locations[0][0]._parameters[slot.locations[0][1]] for slot in bucket.slots]
            locals_ = [dtensor_params.local_of(p) for p in current]
            if any(t.is_meta for t in locals_):
                continue  # still (or again) on meta: nothing to adopt
            for slot, param, local in zip(bucket.slots, current, locals_):
                setattr(param, OWNER_ATTR, getattr(slot.param, OWNER_ATTR, None))
                if local.dtype != bucket.dtype:
                    raise NotImplementedError(
                        f"parameter '{slot.fqn}' changed dtype ({bucket.dtype} -> {local.dtype}) "
                        "after fully_shard: cast the model before sharding it")
                for module, attr in slot.locations:
                    module._parameters[attr] = param
                slot.param = param
            if bucket.shard.is_meta:
                bucket.shard = torch.empty(bucket.shard_numel, dtype=bucket.dtype, device=device)
                bucket.shard_views = bucket.local_views(bucket.shard)
            with torch.no_grad():
                for view, local in zip(bucket.shard_views, locals_):
                    if view.numel() and local.data_ptr() != view.data_ptr():
                        view.copy_(local.reshape(view.shape))
            bucket.point_params_at_shard()
        self._no_grad_view_cache = None

    def wait_unshard(self) -> None:
        if self.pending_unshard is not None:
            with span(f"{self._unshard_kind}.wait", self.name):
                self.pending_unshard.wait()
            self.pending_unshard = None
            if self._copy_out_after_wait is not None:
                targets, self._copy_out_after_wait = self._copy_out_after_wait, None
                self._copy_out(targets)
            self.unsharded = True

    def reshard(self) -> None:
        """Free the unsharded buffers (after any all-gather into them finished)."""
        self.wait_unshard()
        if not self.unsharded:
            return
        k = self.groups.post_forward_size
        keep_chunk = (k > 1 and self.groups.post_forward is not None and self.schedule.in_forward
                      and torch.is_grad_enabled())
        if keep_chunk:  # reshard_after_forward=k: keep 1/k of the unit for a cheaper regather
            self.post_forward_chunks = [
                gather.post_forward_chunks(bucket, full, self.groups.shard_size, k,
                                           self.groups.post_forward_rank)
                for bucket, full in zip(self.buckets, self.full_data)]
        for full in self.full_data:
            storage_cache.release(full)
        self.unsharded = False
        self.schedule.note_reshard(self)
        RECORDER.add("reshard", self.name)

    def _check_params_gathered(self, module, args) -> None:
        if self.params_in_use or self.summoned:
            return
        owned = [(prefix, n) for prefix, member in zip(self.member_names, self.members)
                 for n, m in member.named_modules() if m is module]
        prefix, owned = owned[0] if owned else ("", "")
        name = f"'{prefix}.{owned}'" if prefix and owned else (
            f"'{owned}'" if owned else "a submodule")
        raise RuntimeError(
            f"{type(module).__name__} {name} was called while its parameters are sharded: they "
            f"belong to the unit of {self.type_name} ('{self.name or '<root>'}'), "
            "whose forward is not running. A module outside forward() (e.g. the encoder that "
            "generate() calls) needs the method that calls it registered: "
            "fsdp_ext.register_fsdp_forward_method(model, 'generate') (FullyShardedDataParallel: "
            "or call it inside FullyShardedDataParallel.summon_full_params(model, recurse=False)); "
            "a container whose own forward never runs (ModuleList, ModuleDict) cannot be a unit: "
            "shard its children")

    def use_unsharded_params(self) -> None:
        """Point every module attribute at a view of the gathered buffers (no copy-out)."""
        self.params_in_use = True
        if not torch.is_grad_enabled():
            for module, attr, view in self._no_grad_views():
                module._parameters[attr] = view
            return
        views: dict[int, torch.Tensor] = {}
        tracked = bool(self.grad_bucket_indices)
        if tracked:
            fulls = [self.full[i] for i in self.grad_bucket_indices]
            flat_views = iter(_UnshardedViews.apply(self, *fulls))
            for i in self.grad_bucket_indices:
                for slot in self.buckets[i].slots:
                    views[id(slot)] = next(flat_views)
        for bucket, full in zip(self.buckets, self.full):
            if tracked and bucket.requires_grad:
                continue
            for slot, view in zip(bucket.slots, bucket.full_views(full)):
                views[id(slot)] = view
        for bucket in self.buckets:
            for slot in bucket.slots:
                view = views[id(slot)]
                if slot.tp_spec is not None:  # tensor parallel: the module computes with DTensors
                    view = dtensor_params.tp_view(view, slot.tp_spec)
                for module, attr in slot.locations:
                    module._parameters[attr] = view

    def _no_grad_views(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """(module, attribute, view of the gathered buffer) for every parameter, made once under
        no_grad and kept: the buffers are refilled in their own storages, so views stay valid."""
        if self._no_grad_view_cache is None:
            with torch.no_grad():
                self._no_grad_view_cache = [
                    (module, attr, view if slot.tp_spec is None
                     else dtensor_params.tp_view(view, slot.tp_spec))
                    for bucket, full in zip(self.buckets, self.full)
                    for slot, view in zip(bucket.slots, bucket.full_views(full))
                    for module, attr in slot.locations]
        return self._no_grad_view_cache

    def use_sharded_params(self) -> None:
        self.params_in_use = False
        for bucket in self.buckets:
            for slot in bucket.slots:
                for module, attr in slot.locations:
                    module._parameters[attr] = slot.param

    # ---- forward hooks ----------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        schedule = self.schedule
        if schedule is None or schedule.standalone:
            schedule = _become_root(self)
        if schedule.in_backward():  # recomputation (activation checkpointing) inside backward
            self.unshard(async_op=False)
            self.use_unsharded_params()
            return cast_floating((args, kwargs), self._input_dtype())
        if self.is_root and not self.method_depth:  # not nested in a registered method
            schedule.root_pre_forward()
        if self.summoned:  # inside summon_full_params: the module holds the full parameters
            return cast_floating((args, kwargs), self._input_dtype())
        schedule.record_forward(self)
        RECORDER.add("forward.begin", self.name)
        self.unshard()
        self.wait_unshard()
        self.use_unsharded_params()
        args_kwargs = cast_floating((args, kwargs), self._input_dtype())
        # Last, so that this thread's work above is done before the next unit's all-gather
        # starts to compete with it for the cores (gloo moves the bytes with CPU time).
        schedule.prefetch_forward(self)
        begin_range("forward", self)  # compute only: the all-gather wait is its own range
        return args_kwargs

    def _post_forward(self, module, args, kwargs, output):
        schedule = self.schedule
        if self.method_depth:  # forward called inside a registered method: it still runs
            return self._post_forward_nested(output)
        if self.summoned:
            if self.is_root:
                schedule.root_post_forward()
            return cast_floating(output, self.mp.output_dtype)
        self.use_sharded_params()
        if schedule.in_backward():
            return None
        end_range("forward", self)
        RECORDER.add("forward.end", self.name)
        output = cast_floating(output, self.mp.output_dtype)
        if torch.is_grad_enabled():
            hooked = self._register_pre_backward(output)
            needs_params = any(b.requires_grad for b in self.buckets)
            if self.reshards_after_forward and not schedule.is_last_in_forward(self) and (
                    hooked or not needs_params):
                self.reshard()
        else:
            self.reshard()  # no backward follows: free even the root
        if self.is_root:
            schedule.root_post_forward()
        return output

    def _member_pre_forward(self, module, args, kwargs):
        """A list unit: its first member to run in a forward does the unit's pre-forward; the
        others, whose parameters are then gathered, only cast their inputs. (Recomputation in
        backward runs per member: the pre-forward is idempotent there.)"""
        schedule = self.schedule
        recomputing = schedule is not None and not schedule.standalone and schedule.in_backward()
        if self.members_to_run and not recomputing:
            return cast_floating((args, kwargs), self._input_dtype())
        if not recomputing:
            self.members_to_run = {id(m) for m in self.members}
        return self._pre_forward(module, args, kwargs)

    def _member_post_forward(self, module, args, kwargs, output):
        """A list unit: the post-forward once every member ran; before that, each output gets the
        output dtype and the pre-backward hook (backward may reach it first)."""
        if id(module) not in self.members_to_run:  # recomputation, or a member called again
            if self.schedule.in_backward():
                return self._post_forward(module, args, kwargs, output)
            return cast_floating(output, self.mp.output_dtype)
        self.members_to_run.discard(id(module))
        if self.members_to_run:
            output = cast_floating(output, self.mp.output_dtype)
            if torch.is_grad_enabled() and not self.summoned:
                self._register_pre_backward(output)
            return output
        return self._post_forward(module, args, kwargs, output)

    def finish_forward(self) -> None:
        """The root's forward ended with some members of this list unit not run: their
        post-forward is done here (torch does the same), leaving the parameters sharded."""
        self.members_to_run.clear()
        if self.summoned or not self.params_in_use:
            return
        self.use_sharded_params()
        if not torch.is_grad_enabled() or self.reshards_after_forward:
            self.reshard()

    def _post_forward_nested(self, output):
        """The module's forward ended inside one of its registered methods (e.g. generate()
        calling forward): the parameters stay gathered for the rest of the method."""
        end_range("forward", self)
        output = cast_floating(output, self.mp.output_dtype)
        if torch.is_grad_enabled():
            self._register_pre_backward(output)
        return output

    def run_method(self, method, args, kwargs):
        """A method registered with register_fsdp_forward_method: the unit's pre-forward, the
        method (whose own calls of forward do not reshard), the post-forward."""
        args, kwargs = self._pre_forward(self.module, args, kwargs)
        self.method_depth += 1
        try:
            output = method(*args, **kwargs)
        except BaseException:
            self.method_depth -= 1
            self.use_sharded_params()
            if self.schedule is not None and self.is_root:
                self.schedule.in_forward = False
            self.reshard()
            raise
        self.method_depth -= 1
        result = self._post_forward(self.module, args, kwargs, output)
        return output if result is None else result

    def _input_dtype(self):
        return self.mp.param_dtype if self.mp.cast_forward_inputs else None

    # ---- backward hooks ---------------------------------------------------------------------------
    def _register_pre_backward(self, output) -> bool:
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        for t in tensors:
            t.register_hook(self._pre_backward)
        return bool(tensors)

    def _pre_backward(self, grad):
        schedule = self.schedule
        schedule.backward_started()
        if not self.pre_backward_done:
            self.pre_backward_done = True
            RECORDER.add("backward.begin", self.name)
        if not self.unshard_in_backward:  # set_unshard_in_backward(False): no parameter needed
            schedule.prefetch_backward(self, "pre")
            begin_range("backward", self)
            return None
        # Always make sure the parameters are there: a unit used twice in forward is freed after
        # the backward of its later use and needed again for the earlier one.
        self.unshard()
        self.wait_unshard()
        # A recomputation that calls the module's `forward` without its hooks (transformers'
        # gradient checkpointing wraps `forward`, not `__call__`) reads the module's attributes:
        # they must be the gathered parameters, tracked as in forward so that it saves the same
        # tensors (and, when reentrant, sends the parameters' gradients to post_backward).
        with torch.enable_grad():
            self.use_unsharded_params()
        schedule.prefetch_backward(self, "pre")
        begin_range("backward", self)
        return None

    def post_backward(self, grads) -> None:
        """Gradients of one backward use: reduce every trainable bucket, then free the unit."""
        end_range("backward", self)
        RECORDER.add("backward.end", self.name)
        # Free the gathered parameters before the gradient path allocates its packed buffers:
        # the gradients are computed, nothing reads the parameters again in this use.
        if self.reshard_after_backward:
            self.reshard()
        grads = iter(grads)
        for i in self.grad_bucket_indices:
            reduce_bucket(self, i, [next(grads) for _ in self.buckets[i].slots])
        self.use_sharded_params()
        self.schedule.prefetch_backward(self, "post")

    # ---- what the schedule asks of its units -----------------------------------------------------------
    def join(self, schedule: Schedule, member_names: list[str], is_root: bool) -> None:
        """Become one of `schedule`'s units, named as the root's module tree names it."""
        self.schedule, self.is_root = schedule, is_root
        self.member_names = member_names
        self.name = unit_name(member_names)

    def start_step(self) -> None:
        """At the root's pre-forward: users edit models between steps, so the parameters are
        checked before any collective; what the last step left behind goes."""
        self.members_to_run.clear()  # a list unit some of whose members did not run
        self.check_params_unchanged()
        self.post_forward_chunks = None  # kept by a forward whose backward never ran
        for bucket in self.buckets:
            bucket.release_grad_shard_if_unused()

    def drop_gradient_state(self) -> None:
        """After a failed backward: no_sync accumulation, HSDP partial sums and flags are the
        failed step's; dropped, not applied."""
        for state in self.bucket_grads:
            state.unsharded_accumulator, state.used, state.nonfinite = None, [], None
            state.partial_reduce = None

    def leave_methods(self) -> None:
        """reset_iter_state: a registered method that raised is no longer running."""
        self.method_depth = 0

    def reset_backward_state(self) -> None:
        self.pre_backward_done = False
        # Chunks kept for a backward that did not use them (the unit took no part in it) would be
        # gathered, stale, by the next forward: they belong to this step only.
        self.post_forward_chunks = None


def _become_root(unit: Unit) -> Schedule:
    return Schedule.create(unit)


def ensure_root(unit: Unit) -> None:
    """Make `unit` the root of its units now, as its first forward would (FSDP1's lazy init on
    summon_full_params): a method then called inside the summon (generate() calling the encoder,
    then forward) finds the root's schedule instead of making a sub-unit a root of its own."""
    if unit.schedule is None or unit.schedule.standalone:
        _become_root(unit)


def _owned_modules(module: nn.Module) -> list[nn.Module]:
    """`module` and its descendants, except subtrees that already are units (in module order)."""
    owned, stack = [], [module]
    while stack:
        mod = stack.pop()
        owned.append(mod)
        stack.extend(c for c in reversed(list(mod.children())) if unit_of(c) is None)
    return owned
