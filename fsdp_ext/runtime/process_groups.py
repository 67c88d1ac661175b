"""The process groups the runtime creates: each one once per set of ranks, and never inside a step.

Where each is made:
  * the post-forward groups (`reshard_after_forward=k`): in fully_shard;
  * the issue thread's groups (CPU all-gathers, comm.py): at the root's first forward, for every
    unit's shard and post-forward group, before the first all-gather;
  * the separate reduce-scatter groups: in `set_separate_reduce_scatter_group`.

[Note: a bounded creation]
`dist.new_group` waits, in the store, for every member to join: a member that died or raised
before it would keep the others there for the process group's default timeout (30 min on gloo),
and torch's FSDP2, which creates no group of its own, fails at once in its first all-gather
instead. So before each creation the members meet on the group the new one is carved from:
each writes its arrival into the store, then (gloo) they pass a barrier on that group, where a
dead member's broken connection fails at once, or (other backends) each polls the store for the
others' arrivals. Either is bounded by the collective timeout (comm.collective_timeout), and a
member that did not arrive is named in the CollectiveError every other member raises. After the
meet every member is alive and at the creation, which then only connects them. A collective
timeout of 0 ("no bound but the process group's") skips the meet.

Alternatives considered: `new_group(timeout=...)` bounds the creation's own wait too, but it also
becomes the group's bound for every collective, measured from the collective's start rather than
from its wait, and its error names no rank. Creating the groups in the first all-gather (lazily,
as before) puts the unbounded wait exactly where a rank's first error (a unit's pre-all-gather
check) leaves the others.
"""
from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from .comm import wait_work
from .errors import CollectiveError
from .peer_watch import default_store, poll

_GROUP_CACHE: dict[tuple, dist.ProcessGroup] = {}
_ISSUE_GROUP_CACHE: dict[tuple, dist.ProcessGroup] = {}
_ISSUE_GROUP_BY_GROUP: dict[dist.ProcessGroup, dist.ProcessGroup] = {}  # the lookup, per call
_SEPARATE_GROUP_CACHE: dict[tuple, dist.ProcessGroup] = {}
_MEETS: dict[tuple, int] = {}  # (world, the parent's ranks) -> meets so far, alike on its members
_LATE_ARRIVAL_S = 2.0  # after a broken connection, how long a live member may take to arrive


def _group_once(cache: dict, global_ranks, parent, timeout: datetime.timedelta | None,
                what: str) -> dist.ProcessGroup:
    """The group over `global_ranks` from `cache`, else made after its members met on `parent`
    (every member of `parent` calls this at the same point)."""
    # Keyed by the default group too: after destroy_process_group and a new init, groups of the
    # old world are dead even where their ranks match.
    key = (dist.group.WORLD, tuple(global_ranks))
    if key not in cache:
        if parent is not None and timeout is not None:
            meet(parent, timeout, f"{what} over ranks {list(global_ranks)}")
        cache[key] = dist.new_group(list(global_ranks), use_local_synchronization=True)
    return cache[key]


def meet(parent: dist.ProcessGroup, timeout: datetime.timedelta, what: str) -> None:
    """Return once every member of `parent` reached this call; else raise CollectiveError, within
    `timeout`, naming the members that did not (see [Note: a bounded creation])."""
    ranks = dist.get_process_group_ranks(parent)
    if len(ranks) == 1:
        return
    count_key = (dist.group.WORLD, tuple(ranks))
    _MEETS[count_key] = _MEETS.get(count_key, 0) + 1
    prefix = f"fsdp_ext/meet/{'-'.join(map(str, ranks))}/{_MEETS[count_key]}"
    store, me = default_store(), dist.get_rank()
    try:
        store.set(f"{prefix}/{me}", "1")
        if dist.get_backend(parent) == "gloo":
            wait_work(dist.barrier(group=parent, async_op=True), timeout)
        elif not poll(store, [f"{prefix}/{r}" for r in ranks], timeout.total_seconds()):
            raise TimeoutError(f"timed out after {timeout.total_seconds():g} s")
    except Exception as exc:
        _say_gave_up(store, prefix)
        timed_out = "timed out" in str(exc).lower()
        how = (f"within {timeout.total_seconds():g} s (collective_timeout)" if timed_out
               else "(a member's connection broke: it exited or died)")
        # A broken connection fails at once: give the live members a moment to show up.
        missing = _absent(store, prefix, ranks, 0.0 if timed_out else _LATE_ARRIVAL_S)
        raise CollectiveError(f"rank {me}: cannot create {what}: {missing} {how}; every member "
                              f"makes it at the same point: {exc}") from exc
    # A member that gave up on this one may still be alive (its error caught), and its abandoned
    # barrier may just have paired with ours: the creation would then wait for it unbounded.
    if store.check([f"{prefix}/gave_up"]):
        raise CollectiveError(f"rank {me}: cannot create {what}: this rank arrived after the "
                              f"others' collective_timeout of {timeout.total_seconds():g} s, "
                              "and they gave up waiting for it")


def _say_gave_up(store, prefix: str) -> None:
    try:
        store.set(f"{prefix}/gave_up", "1")
    except Exception:  # the store lives in rank 0's process
        pass


def _absent(store, prefix: str, ranks: list[int], grace_s: float) -> str:
    """Who did not arrive at the meet `prefix`, within `grace_s` from now."""
    missing = list(ranks)
    deadline = time.monotonic() + grace_s
    try:
        while True:
            missing = [r for r in missing if not store.check([f"{prefix}/{r}"])]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    except Exception:  # the store lives in rank 0's process
        return "the store (in rank 0's process) is unreachable: rank 0 exited or died"
    if not missing:
        return "every member arrived, the last one as the wait ended"
    return f"rank(s) {missing} did not arrive (dead, stuck, or running other code)"


def subgroup(global_ranks: list[int], parent=None,
             timeout: datetime.timedelta | None = None) -> dist.ProcessGroup:
    """A process group over `global_ranks`, created once (only its members need to call this;
    with `parent`, every member of `parent` does, and they meet first)."""
    return _group_once(_GROUP_CACHE, global_ranks, parent, timeout, "a subgroup")


def issue_thread_group(group: dist.ProcessGroup | None,
                       timeout: datetime.timedelta | None = None) -> dist.ProcessGroup | None:
    """A second process group over the ranks of `group`, used only by the issue thread.

    The members of a process group must issue its collectives in the same order; the compute
    thread's collectives (gradient reductions, checks) and the issue thread's all-gathers
    interleave differently on every rank, so each kind gets its own group. Made for every unit
    at the root's first forward (`make_issue_thread_groups`); the all-gathers look it up.
    """
    if group is None:
        return None
    if (found := _ISSUE_GROUP_BY_GROUP.get(group)) is None:
        found = _ISSUE_GROUP_BY_GROUP[group] = _group_once(
            _ISSUE_GROUP_CACHE, dist.get_process_group_ranks(group), group, timeout,
            "the issue thread's process group (made at the root's first forward)")
    return found


def make_issue_thread_groups(units, issue_thread: bool,
                             timeout: datetime.timedelta | None) -> None:
    """The issue thread's group of every group `units` all-gather over, made now (a root's first
    forward, before any collective), in the units' order, alike on every rank."""
    if not issue_thread:
        return
    for unit in units:
        for group in (unit.groups.shard, unit.groups.post_forward,  # (own meshes: placements.py)
                      *(g for b in unit.buckets for g in (b.groups.shard, b.groups.post_forward))):
            issue_thread_group(group, timeout)


def separate_group(group: dist.ProcessGroup | None,
                   timeout: datetime.timedelta | None = None) -> dist.ProcessGroup | None:
    """Another process group over `group`'s ranks (one per rank set), for the reductions."""
    if group is None:
        return None
    return _group_once(_SEPARATE_GROUP_CACHE, dist.get_process_group_ranks(group), group,
                       timeout, "the separate reduce-scatter group")


def post_forward_group(shard: dist.ProcessGroup | None, size: int,
                       timeout: datetime.timedelta | None = None) -> dist.ProcessGroup | None:
    """The `size` consecutive ranks of the shard group that this rank regathers with in backward.

    Consecutive ranks are the ones on the same node, as in FSDP2's `reshard_after_forward=int`.
    """
    if shard is None or size <= 1:
        return None
    ranks = dist.get_process_group_ranks(shard)
    if len(ranks) % size:
        raise ValueError(
            f"reshard_after_forward={size} must divide the shard group size {len(ranks)}")
    start = dist.get_rank(shard) // size * size
    return _group_once(_GROUP_CACHE, ranks[start:start + size], shard, timeout,
                       f"the post-forward group (reshard_after_forward={size})")

