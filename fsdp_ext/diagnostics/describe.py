"""`describe(model)`: the sharding plan in words: units, buckets, bytes per rank, prefetch order.

    plan = fsdp_ext.describe(model)      # prints it and returns the same text

Everything is read from the units themselves (what this rank holds), so the text is what the runtime
does, not a re-derivation of it. The execution order is learned during the first forward; before
that, the prefetch section says so.
"""
from __future__ import annotations

import sys


from torch import nn

from ..runtime.core.registry import unit_name, units_with_paths
from ..runtime.unit.unit import Unit


def _units_with_names(model: nn.Module) -> list[tuple[str, Unit, list[str]]]:
    """Each unit once: its name ('[a, b]' for a list of modules, in the list's order), the unit,
    and the path of each of its modules (known here before the first forward names them)."""
    inner = getattr(model, "_fsdp_wrapped_module", model)  # FullyShardedDataParallel adds no prefix
    return [(unit_name(paths), unit, paths) for unit, paths in units_with_paths(inner).items()]


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _dtype(d) -> str:
    return str(d).replace("torch.", "")


def _kind(bucket) -> str:
    return bucket.wire.describe(bucket)


def _wire(unit: Unit) -> str:
    """The unit's CommPolicy: its own, the root's once resolved, or exact."""
    policy = unit.config.comm_policy
    if policy is None and unit.schedule is not None:
        policy = unit.schedule.root.config.comm_policy
        return f"{policy.describe()} (the root's)" if policy is not None else "exact"
    if policy is None:
        return "exact, or the root's CommPolicy (known at the first forward)"
    return policy.describe()


def _describe_unit(name: str, unit: Unit, paths: list[str]) -> tuple[list[str], int, int]:
    """Lines for one unit, its sharded bytes and its unsharded (gathered) bytes on this rank."""
    schedule = unit.schedule
    if unit.reshard_after_forward is None and schedule is None:
        keep = "freed, or kept if it is the root (known at the first forward)"
    elif not unit.reshards_after_forward:
        keep = "kept (root)" if unit.is_root else "kept"
    elif schedule is not None and schedule.is_last_in_forward(unit):
        keep = "kept (last to run forward: backward starts with it)"
    else:
        keep = "freed"
    lines = [f"unit '{name or 'root'}' ({unit.type_name}): "
             f"{len(unit.buckets)} bucket(s); after forward: {keep}; on the wire: "
             f"{_wire(unit)}"]
    module_names = {id(m): n if len(paths) == 1 else _joined(path, n)
                    for member, path in zip(unit.members, paths)
                    for n, m in member.named_modules(remove_duplicate=False)}
    sharded = unsharded = 0
    for i, (bucket, full) in enumerate((b, b.full_data) for b in unit.buckets):
        layout = bucket.layout
        used = sum(slot.numel for slot in bucket.slots)
        shard_bytes = bucket.sharded_bytes()
        full_bytes = bucket.full_numel * full.element_size()
        sharded, unsharded = sharded + shard_bytes, unsharded + full_bytes
        copied = sum(len(g.slots) for g in layout.groups if g.copied)
        lines.append(
            f"  bucket {i}: {_dtype(bucket.dtype)}, requires_grad={bucket.requires_grad}, "
            f"{len(bucket.slots)} param(s) ({_kind(bucket)}), "
            f"{used:,} elements; {bucket.shard_numel:,} per rank, padding included; "
            f"{len(layout.groups)} all-gather(s), {copied} param(s) copied out")
        lines.append(f"            per rank: sharded {_bytes(shard_bytes)}, unsharded "
                     f"{_bytes(full_bytes)} as {_dtype(full.dtype)}")
        lines += ["            " + line
                  for line in bucket.slots[0].placement.describe(bucket.groups)]
        names = [slot.fqn if len(paths) == 1 else _joined(paths[slot.member], slot.fqn)
                 for slot in bucket.slots]
        width = max(map(len, names))
        for index, (slot, slot_name) in enumerate(zip(bucket.slots, names)):
            lo, hi = layout.local_range(index)
            tied = [_joined(module_names.get(id(m), type(m).__name__), a)
                    for m, a in slot.locations[1:]]
            lines.append(
                f"    {slot_name:<{width}}  {str(list(slot.shape)):<14} {_dtype(bucket.dtype):<9} "
                f"requires_grad={str(slot.param.requires_grad):<5}  shard offset {lo:>9,}  "
                f"this rank {hi - lo:>8,}"
                + (f"  Shard({layout.slots[index].dim})" if layout.slots[index].dim else "")
                + (f"  tied: {', '.join(tied)}" if tied else ""))
    return lines, sharded, unsharded


def _prefetch_lines(units: list[tuple[str, Unit, list[str]]]) -> list[str]:
    schedule = units[0][1].schedule if units else None
    if schedule is None or not schedule.forward_order:
        return ["prefetch order: not recorded yet (the runtime learns the execution order during "
                "the first forward; run one step, then describe again)"]
    names = {id(u): n or "root" for n, u, _ in units}
    order = schedule.forward_order
    opts = schedule.options

    def regathered(u: Unit) -> bool:  # needs an all-gather again in backward
        return u.reshards_after_forward and not schedule.is_last_in_forward(u)

    def ahead(seq: list[Unit], depth: int, needed) -> list[str]:
        return [", ".join(names[id(v)] for v in seq[i + 1:i + 1 + depth] if needed(v)) or "-"
                for i in range(len(seq))]

    back = order[::-1]
    fwd_ahead = ahead(order, opts.forward_prefetch, lambda v: True)
    bwd_ahead = ahead(back, opts.backward_prefetch, regathered)
    bound = schedule.max_in_flight()
    lines = [f"forward order (recorded): {' -> '.join(names[id(u)] for u in order)}",
             f"forward prefetch depth {opts.forward_prefetch}: all-gathers issued before each "
             "unit computes"]
    lines += [f"  {names[id(u)]:<20} prefetches {a}" for u, a in zip(order, fwd_ahead)]
    lines.append(f"backward order: {' -> '.join(names[id(u)] for u in back)}; regathered: "
                 + (", ".join(names[id(u)] for u in back if regathered(u)) or "none"))
    lines.append(f"backward prefetch depth {opts.backward_prefetch} "
                 f"({'before' if opts.backward_prefetch_at == 'pre' else 'after'} each unit's "
                 "backward compute)")
    lines += [f"  {names[id(u)]:<20} prefetches {a}" for u, a in zip(back, bwd_ahead)]
    lines.append("in-flight bound: " + (f"at most {bound} freed-after-forward units unsharded"
                                        if bound is not None else "none"))
    return lines


def describe(model: nn.Module, file=sys.stdout) -> str:
    """Print (to `file`, unless None) and return the unit tree and prefetch plan of `model`."""
    units = _units_with_names(model)
    if not units:
        text = f"{type(model).__name__}: no fsdp_ext units (apply fully_shard first)"
    else:
        g = units[0][1].groups
        lines = [f"fsdp_ext plan for {type(model).__name__}: {len(units)} unit(s), shard group of "
                 f"{g.shard_size} (this is shard rank {g.shard_rank}), {g.replicate_size} "
                 f"replica(s), device {g.device}"]
        if g.single_process:
            lines.append("single-process mode: no process group and no launcher, nothing is "
                         "sharded (launch with torchrun, or init_process_group() first)")
        total_sharded, largest = 0, 0
        for name, unit, paths in units:
            unit_lines, sharded, unsharded = _describe_unit(name, unit, paths)
            lines += unit_lines
            total_sharded += sharded
            largest = max(largest, unsharded)
        lines.append(f"total per rank: sharded {_bytes(total_sharded)}; largest unsharded unit "
                     f"{_bytes(largest)}")
        lines += _prefetch_lines(units)
        text = "\n".join(lines)
    if file is not None:
        print(text, file=file)
    return text
