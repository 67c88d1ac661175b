"""The process groups the runtime creates: each one once per set of ranks, and never inside a step.

Where each is made:
  * at the root's first forward, before its first collective (`make_first_forward_groups`), for
    every unit: the post-forward groups (`reshard_after_forward=k`), then the issue thread's
    groups (CPU all-gathers, comm.py) over every unit's shard and post-forward group. The
    post-forward groups wait until then, rather than being made in the child's fully_shard, so
    that the root's collective_timeout, which applies to its whole model, bounds their meet;
  * the separate reduce-scatter groups: in `set_separate_reduce_scatter_group`.

[Note: a bounded creation]
`dist.new_group` waits, in the store, for every member to join: a member that died or raised
before it would keep the others there for the process group's default timeout (30 min on gloo),
and torch's FSDP2, which creates no group of its own, fails at once in its first all-gather
instead. So before each creation the members meet on the group the new one is carved from:
each writes its arrival into the store, then (gloo) they pass a barrier on that group, where a
dead member's broken connection fails at once, or (other backends) each polls the store for the
others' arrivals. A member that did not arrive is named in the CollectiveError every other member
raises, with how long they waited; the late member, when it arrives, raises saying the others
gave up waiting for it. After the meet every member is alive and at the creation, which then only
connects them. The meet waits as long as collective_timeout (comm.collective_timeout) where the
user set one; a collective timeout of 0 ("no bound but the process group's") skips it. Left at
its default, the meet waits the process group's own timeout: the meets come before a model's
first collective, where a rank loading a checkpoint or a dataset index alone is normal, and
torch's first collective would wait that long too. Without the issue thread (accelerators,
FSDP_EXT_ISSUE_THREAD=0) the members of each shard group meet once, all the same, at the first
forward: so the first collective never waits under the shorter default bound.

Alternatives considered: `new_group(timeout=...)` bounds the creation's own wait too, but it also
becomes the group's bound for every collective, measured from the collective's start rather than
from its wait, and its error names no rank. Creating the groups in the first all-gather (lazily,
as before) puts the unbounded wait exactly where a rank's first error (a unit's pre-all-gather
check) leaves the others.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from ..core.errors import CollectiveError
from .collectives import DefaultTimeout, wait_work
from .groups import record_made_later
from .peer_watch import default_store, poll

_GROUP_CACHE: dict[tuple, dist.ProcessGroup] = {}
_ISSUE_GROUP_CACHE: dict[tuple, dist.ProcessGroup] = {}
_ISSUE_GROUP_BY_GROUP: dict[dist.ProcessGroup, dist.ProcessGroup] = {}  # the lookup, per call
_SEPARATE_GROUP_CACHE: dict[tuple, dist.ProcessGroup] = {}
_FIRST_MEETS: set[tuple] = set()  # shard groups met at a first forward without the issue thread
_MEETS: dict[tuple, int] = {}  # (world, the parent's ranks) -> meets so far, alike on its members
_LATE_ARRIVAL_S = 2.0  # after a broken connection, how long a live member may take to arrive
_PG_BOUND = "the process group's timeout; collective_timeout not set"


def _group_once(cache: dict, global_ranks, parent, timeout: datetime.timedelta | None,
                what: str) -> dist.ProcessGroup:
    """The group over `global_ranks` from `cache`, else made after its members met on `parent`
    (every member of `parent` calls this at the same point)."""
    # Keyed by the default group too: after destroy_process_group and a new init, groups of the
    # old world are dead even where their ranks match.
    key = (dist.group.WORLD, tuple(global_ranks))
    if key not in cache:
        if parent is not None and timeout is not None:
            meet(parent, timeout, f"create {what} over ranks {list(global_ranks)}")
        cache[key] = dist.new_group(list(global_ranks), use_local_synchronization=True)
    return cache[key]


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """`group`'s own timeout (init_process_group's or new_group's `timeout` argument)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for this device (or a torch without the attribute)
            continue
    return dist.default_pg_timeout


def meet(parent: dist.ProcessGroup, timeout: datetime.timedelta, what: str) -> None:
    """Return once every member of `parent` reached this call (to do `what`, e.g. "create the
    post-forward group ..."); else raise CollectiveError, within `timeout` (a DefaultTimeout:
    `parent`'s own), naming the members that did not, or, on a member that arrived after the
    others gave up, saying so (see [Note: a bounded creation])."""
    ranks = dist.get_process_group_ranks(parent)
    if len(ranks) == 1:
        return
    bound = "collective_timeout"
    if isinstance(timeout, DefaultTimeout):
        timeout, bound = group_timeout(parent), _PG_BOUND
    seconds = timeout.total_seconds()
    count_key = (dist.group.WORLD, tuple(ranks))
    _MEETS[count_key] = _MEETS.get(count_key, 0) + 1
    prefix = f"fsdp_ext/meet/{'-'.join(map(str, ranks))}/{_MEETS[count_key]}"
    store, me = default_store(), dist.get_rank()
    try:
        store.set(f"{prefix}/{me}", "1")
        if dist.get_backend(parent) == "gloo":
            wait_work(dist.barrier(group=parent, async_op=True), timeout)
        elif not poll(store, [f"{prefix}/{r}" for r in ranks], seconds):
            raise TimeoutError(f"timed out after {seconds:g} s")
    except Exception as exc:
        _raise_if_late(store, prefix, me, what, exc)
        timed_out = "timed out" in str(exc).lower()
        # A broken connection fails at once: give the live members a moment to show up.
        missing = _absent(store, prefix, ranks, 0.0 if timed_out else _LATE_ARRIVAL_S)
        if missing:  # read by the late members when they arrive
            _say_gave_up(store, prefix, f"{me}|{seconds:g}|{bound}|{missing}")
        how = (f"within {seconds:g} s ({bound})" if timed_out
               else "(a member's connection broke: it exited or died)")
        hint = ("; to wait longer, give init_process_group a longer timeout or set "
                "collective_timeout" if timed_out and bound == _PG_BOUND else "")
        raise CollectiveError(f"rank {me}: cannot {what}: {_who(missing)} {how}; every "
                              f"member makes it at the same point{hint}: {exc}") from exc
    # A member that gave up on this one may still be alive (its error caught), and its abandoned
    # barrier may just have paired with ours: the creation would then wait for it unbounded.
    _raise_if_late(store, prefix, me, what, None)
    if store.check([f"{prefix}/gave_up"]):
        raise CollectiveError(f"rank {me}: cannot {what}: another member gave up waiting "
                              "for one that arrived late; every member makes it at the same point")


def _raise_if_late(store, prefix: str, me: int, what: str, exc: Exception | None) -> None:
    """Raise, on a member the others named as absent when they gave up, that they did so."""
    try:
        if not store.check([f"{prefix}/gave_up"]):
            return
        giver, seconds, bound, missing = store.get(f"{prefix}/gave_up").decode().split("|")
    except Exception:  # the store lives in rank 0's process: the caller reports it gone
        return
    if str(me) in missing.strip("[]").split(", "):
        raise CollectiveError(
            f"rank {me}: cannot {what}: this rank arrived after the others gave up waiting "
            f"for it (rank {giver} waited {seconds} s: {bound}); every member makes it at the "
            "same point") from exc


def _say_gave_up(store, prefix: str, account: str) -> None:
    try:
        store.set(f"{prefix}/gave_up", account)
    except Exception:  # the store lives in rank 0's process
        pass


def _absent(store, prefix: str, ranks: list[int], grace_s: float) -> list[int] | None:
    """Who did not arrive at the meet `prefix`, within `grace_s` from now (None: the store is
    unreachable)."""
    missing = list(ranks)
    deadline = time.monotonic() + grace_s
    try:
        while True:
            missing = [r for r in missing if not store.check([f"{prefix}/{r}"])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)
    except Exception:  # the store lives in rank 0's process
        return None


def _who(missing: list[int] | None) -> str:
    if missing is None:
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
    at the root's first forward (`make_first_forward_groups`); the all-gathers look it up.
    """
    if group is None:
        return None
    if (found := _ISSUE_GROUP_BY_GROUP.get(group)) is None:
        found = _ISSUE_GROUP_BY_GROUP[group] = _group_once(
            _ISSUE_GROUP_CACHE, dist.get_process_group_ranks(group), group, timeout,
            "the issue thread's process group (made at the root's first forward)")
    return found


def make_first_forward_groups(units, issue_thread: bool,
                              timeout: datetime.timedelta | None) -> None:
    """The groups `units` need, made now (a root's first forward, before any collective, under
    the root's `timeout`), in the units' order, alike on every rank: each unit's and own mesh's
    post-forward group (`reshard_after_forward=k`), then the issue thread's group of every group
    they all-gather over; without the issue thread, a meet on each shard group instead (see
    [Note: a bounded creation])."""
    every = [g for unit in units for g in unit.every_groups()]
    for groups in every:
        if groups.post_forward is None and groups.post_forward_size > 1:
            record_made_later("post_forward", groups.shard, groups.post_forward_size,
                              post_forward_group(groups.shard, groups.post_forward_size, timeout))
    for groups in every:
        if issue_thread:
            for group in (groups.shard, groups.post_forward):
                issue_thread_group(group, timeout)
        elif groups.shard is not None and timeout is not None:
            key = (dist.group.WORLD, tuple(dist.get_process_group_ranks(groups.shard)))
            if key not in _FIRST_MEETS:
                _FIRST_MEETS.add(key)
                meet(groups.shard, timeout, "start the root's first forward over ranks "
                     f"{list(key[1])}")


def separate_group(group: dist.ProcessGroup | None,
                   timeout: datetime.timedelta | None = None) -> dist.ProcessGroup | None:
    """Another process group over `group`'s ranks (one per rank set), for the reductions."""
    if group is None:
        return None
    made = _group_once(_SEPARATE_GROUP_CACHE, dist.get_process_group_ranks(group), group,
                       timeout, "the separate reduce-scatter group")
    record_made_later("reduce_scatter", group, 0, made)
    return made


def post_forward_group(shard: dist.ProcessGroup | None, size: int,
                       timeout: datetime.timedelta | None = None) -> dist.ProcessGroup | None:
    """The `size` consecutive ranks of the shard group that this rank regathers with in backward.

    Consecutive ranks are the ones on the same node, as in FSDP2's `reshard_after_forward=int`.
    """
    if shard is None or size <= 1:
        return None
    check_post_forward(shard, size)
    ranks = dist.get_process_group_ranks(shard)
    start = dist.get_rank(shard) // size * size
    return _group_once(_GROUP_CACHE, ranks[start:start + size], shard, timeout,
                       f"the post-forward group (reshard_after_forward={size})")



def check_post_forward(shard: dist.ProcessGroup, size: int) -> None:
    """Refuse a `reshard_after_forward=size` that does not divide the shard group (at the call;
    the group itself is made at the root's first forward)."""
    if dist.get_world_size(shard) % size:
        raise ValueError(f"reshard_after_forward={size} must divide the shard group size "
                         f"{dist.get_world_size(shard)}")
