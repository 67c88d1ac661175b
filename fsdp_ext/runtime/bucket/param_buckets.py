"""Which parameters a unit owns, the buckets they form, and the sharded state made from them.

A unit owns the parameters of its module's subtree that no unit below it owns. They are grouped by
(dtype, requires_grad) into buckets (bucket.py), each laid out by layout.py: "flat" for
FullyShardedDataParallel, "rows" (DTensor Shard(0)) for fully_shard. For the rows layout with a
process group, the user's parameters are replaced by DTensor parameters over this rank's shard
(as torch's fully_shard does: build the optimizer after sharding).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ... import ops
from ..comm import collectives as comm
from ..placement import dtensor_params
from .deferred_init import materialize_meta_modules
from .bucket import OWNER_ATTR, Bucket, ParamSlot, mark_owner
from .layout import flat_layout, rows_layout
from ..placement.base import Placement
from ..placement.choose import initial
from ..placement.shard_fn import resolve
from ..core.registry import unit_of
from ..wire.exact import ExactWire
from ..wire.subclass import SubclassWire, check_hooks, is_extension_tensor

# fully_shard's default split (layout.py, [Note: gather groups]): parameters of at least this many
# elements are gathered directly, the rest together and copied out. Chosen by measurement:
# docs/benchmarks.md, "Gathering DTensor parameters". The option of shard_module, else
# FSDP_EXT_DIRECT_MIN_NUMEL (fsdp_ext/env.py), overrides it (1: every parameter direct; a huge value:
# every one copied out).
DIRECT_MIN_NUMEL = 1 << 16


def build_unit_buckets(members: list[nn.Module], config):
    """A unit's (storage mesh, buckets) for its UnitConfig: its meta parameters materialised
    first where asked (the flat layout always, with reset_parameters() by default; the rows
    layout only with `param_init_fn`, else they wait for the user's `to_empty`, as in torch's
    fully_shard)."""
    groups, layout = config.groups, config.layout
    if layout == "flat" or config.param_init_fn is not None:
        materialize_meta_modules([m for member in members for m in _owned_modules(member)],
                                 groups.device, config.param_init_fn)
    mesh = (dtensor_params.storage_mesh(config.mesh, groups.shard, groups.replicate,
                                        groups.device) if layout == "rows" else None)
    direct_min_numel = (config.direct_min_numel or config.env.direct_min_numel
                        or DIRECT_MIN_NUMEL)
    buckets = build_buckets(members, groups, layout, mesh, direct_min_numel,
                            config.ignored_params, config.shard_placement_fn, config.storage_axes)
    return mesh, buckets


def build_buckets(modules: list[nn.Module], groups: comm.Groups, layout: str, mesh,
                  direct_min_numel: int, ignored: set[int] = frozenset(),
                  shard_placement_fn=None, storage_axes=None) -> list[Bucket]:
    """Group the parameters this unit owns (in its modules, not in child units, nor the `ignored`
    ids) by (their placement's mesh, dtype, requires_grad, wire format) and lay each group out
    ("flat" or "rows"; with a `mesh`, rows are DTensors on it, each sharded along the dim, and
    over the mesh, that its placement gives: placement/; a bucket on a mesh of its own talks to
    that mesh's groups)."""
    def place(slot: ParamSlot, module: nn.Module) -> Placement:
        subclass = is_extension_tensor(dtensor_params.local_of(slot.param))
        if subclass:
            _check_extension_param(slot, module, layout, mesh)
        if layout != "rows":
            return slot.placement
        placed = resolve(shard_placement_fn, slot, module, subclass, mesh)
        placed.check(f"parameter '{slot.fqn}' of {type(module).__name__}", storage_axes)
        return placed

    by_key: dict[tuple, list[ParamSlot]] = {}
    for slot in _owned_slots(modules, layout, ignored, storage_axes, place):
        extension = is_extension_tensor(dtensor_params.local_of(slot.param))
        by_key.setdefault((slot.placement.mesh, slot.param.dtype, slot.param.requires_grad,
                           extension), []).append(slot)
        mark_owner(slot.param, f"{type(modules[slot.member]).__name__} (parameter '{slot.fqn}')")
    buckets, placed_on = [], {}
    for (own, dtype, requires_grad, extension), bucket_slots in by_key.items():
        first = bucket_slots[0]
        if own not in placed_on:  # (equal meshes: one key, one set of groups)
            placed_on[own] = first.placement.storage(
                groups, mesh, f"fully_shard({type(modules[first.member]).__name__}): "
                              f"parameter '{first.fqn}'")
        on, bucket_mesh = placed_on[own]
        world, rank = on.shard_size, on.shard_rank
        shapes = [tuple(s.shape) for s in bucket_slots]
        if layout == "flat":
            bucket_layout = flat_layout(shapes, world, rank)
        else:
            bucket_layout = rows_layout(shapes, world, rank, direct_min_numel,
                                        [s.placement.dim for s in bucket_slots])
        spec_of = None
        if layout == "rows" and bucket_mesh is not None:
            specs = [s.placement.face_spec(bucket_mesh, s.shape, dtype) for s in bucket_slots]
            spec_of = specs.__getitem__
        # The wire format, chosen here once (a CommPolicy may replace an exact one: wire/quantized.py)
        wire = SubclassWire() if extension else ExactWire()
        buckets.append(Bucket(dtype, requires_grad, bucket_slots, bucket_layout, wire, on,
                              spec_of))
    return buckets


def init_sharded_state(buckets: list[Bucket], device: torch.device, offload,
                       param_dtype: torch.dtype | None) -> None:
    """Every bucket's shard, filled with this rank's part of the parameters (each wire format
    says how: wire/), and its gathered buffer, without storage until first gathered."""
    for bucket in buckets:
        bucket.wire.init_shard(bucket, device, offload)
        bucket.init_gathered(device, param_dtype)


def _owned_slots(modules: list[nn.Module], layout: str, ignored: set[int], storage_axes,
                 place) -> list[ParamSlot]:
    """The distinct parameters of `modules` outside child units, in module order; a slot's name
    is relative to the member that holds it (the first, for a parameter tied across members);
    its placement what its own spelling gives (placement/choose.py), then `place(slot, module)`."""
    slots: dict[int, ParamSlot] = {}
    child_owner: dict[int, str] = {}
    stack = [(module, "", member) for member, module in reversed(list(enumerate(modules)))]
    while stack:
        mod, prefix, member = stack.pop()
        module = modules[member]
        for attr, param in mod._parameters.items():
            if param is None or id(param) in ignored:
                continue
            fqn = prefix + attr
            if id(param) in child_owner:
                raise ValueError(
                    f"parameter '{fqn}' is shared with '{child_owner[id(param)]}', which belongs to "
                    "another fully_shard unit; tied weights must live in one unit (wrap their "
                    "common parent instead)")
            if id(param) in slots:
                slots[id(param)].locations.append((mod, attr))
                continue
            if (owner := getattr(param, OWNER_ATTR, None)) is not None:
                raise ValueError(
                    f"parameter '{fqn}' of {type(module).__name__} already belongs to the unit of "
                    f"{owner}; apply fully_shard bottom-up (submodules before their parents)")
            _check_param(param, fqn, module, layout)
            # (a DTensor split by model parallelism: its local tensor is what is sharded here)
            slot = ParamSlot(param, fqn, [(mod, attr)], dtensor_params.local_of(param).shape,
                             placement=initial(param, storage_axes, f"fully_shard("
                                               f"{type(module).__name__}): parameter '{fqn}'"),
                             member=member)
            slots[id(param)] = replace(slot, placement=place(slot, module))
        for name, child in reversed(list(mod._modules.items())):
            if child is None:
                continue
            child_unit = unit_of(child)
            if child_unit is not None:
                for bucket in child_unit.buckets:
                    for slot in bucket.slots:
                        child_owner[id(slot.param)] = prefix + name + "." + slot.fqn
                        if (original := slot.replaced()) is not None:
                            child_owner[id(original)] = prefix + name + "." + slot.fqn
                continue
            stack.append((child, prefix + name + ".", member))
    for pid, owner in child_owner.items():
        if pid in slots:
            raise ValueError(f"parameter '{slots[pid].fqn}' is shared with '{owner}', which "
                             "belongs to another fully_shard unit; tied weights must live in one unit")
    return list(slots.values())


def _check_param(param: nn.Parameter, fqn: str, module: nn.Module, layout: str) -> None:
    where = f"parameter '{fqn}' of {type(module).__name__}"
    if not torch.is_floating_point(param) or param.dtype not in ops.checks.FLOAT_DTYPES:
        raise TypeError(f"{where} has dtype {param.dtype}; fsdp_ext shards fp32/bf16/fp16 only")
    if dtensor_params.is_dtensor(param) and layout != "rows":
        raise NotImplementedError(
            f"{where} is already a DTensor: fully_shard shards tensor-parallel parameters "
            "(FullyShardedDataParallel none)")
    if layout == "rows" and param.dim() == 0:
        raise NotImplementedError(
            f"{where} is 0-dimensional: fully_shard shards parameters along dim 0 (Shard(0)); "
            "give it shape [1], or leave it out of the sharded module")


def _check_extension_param(slot: ParamSlot, module: nn.Module, layout: str, mesh) -> None:
    """What a tensor-subclass parameter needs (wire/subclass.py), refused at the call otherwise."""
    where = f"parameter '{slot.fqn}' of {type(module).__name__}"
    local = dtensor_params.local_of(slot.param)
    kind = type(local).__name__
    check_hooks(local, where)
    if layout != "rows":
        raise NotImplementedError(
            f"{where} is a {kind} (a tensor subclass): FullyShardedDataParallel flattens "
            "parameters into one buffer, which a subclass cannot join (torch's FSDP1 cannot "
            "either); shard the model with fully_shard, which gathers it through its "
            "fsdp_pre_all_gather / fsdp_post_all_gather hooks")
    slot.placement.require_whole(lambda: NotImplementedError(
        f"{where} is a tensor-parallel DTensor over a {kind}: fully_shard gathers tensor "
        "subclasses on a 1-D data-parallel mesh only"))
    if mesh is None:
        raise NotImplementedError(
            f"{where} is a {kind} (a tensor subclass): gathering it through its hooks needs a "
            "process group (torch.distributed.init_process_group) or a device mesh")
    if slot.param.is_meta:
        raise NotImplementedError(
            f"{where} is a {kind} on the meta device: build tensor-subclass parameters "
            "with their data before fully_shard")


def _owned_modules(module: nn.Module) -> list[nn.Module]:
    """`module` and its descendants, except subtrees that already are units (in module order)."""
    owned, stack = [], [module]
    while stack:
        mod = stack.pop()
        owned.append(mod)
        stack.extend(c for c in reversed(list(mod.children())) if unit_of(c) is None)
    return owned
