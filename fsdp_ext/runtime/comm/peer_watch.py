"""The peer watch: which rank stopped issuing collectives, and where it was.

Every wait on a collective is bounded (comm.collective_timeout: 300 s by default, well under the
process group's own timeout). A daemon thread keeps a heartbeat per rank in the process group's
store (every 0.5 s: the time, and the collective the rank is blocked on, if any). When a wait ends
without an answer (the bound, or a peer's broken connection), the rank reads the other members'
heartbeats: those waiting on a collective too are fine; one alive in its own code (stuck) or
without a fresh heartbeat (exited, died) has stopped issuing collectives, and the CollectiveError
names it with its last progress record (written twice per iteration, one forward of the root: as
it starts and when backward ends).

The same store carries the ranks' accounts of a mismatched collective (collective_tags.py) and the
meets before a process group's creation (process_groups.py): `default_store` and `poll` are theirs
too.
"""
from __future__ import annotations

import datetime
import itertools
import threading
import time
import weakref

import torch.distributed as dist

from ..core.errors import CollectiveError

_NAMESPACES = itertools.count()  # watches made in this process, in the same order on every rank
STORE_WAIT_S = 10.0  # how long to wait for the other ranks' records (a mismatch's accounts)
_HEARTBEAT_PERIOD_S = 0.5
_HEARTBEAT_STALE_S = 2.5  # a heartbeat older than this: the process is gone
_HEARTBEAT_GRACE_S = 3.0  # after a stall, how long to let running peers start waiting
# The heartbeat thread and the training thread share the store's one client connection, which
# must not carry two requests at once.
_STORE_LOCK = threading.Lock()


class _LockedStore:
    """The process group's store, one request at a time; `get` only of keys that exist (a
    TCPStore `get` of a missing key waits for it)."""

    def __init__(self, store):
        self.store = store

    def set(self, key: str, value: str) -> None:
        with _STORE_LOCK:
            self.store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        with _STORE_LOCK:
            return self.store.check(keys)

    def get(self, key: str) -> bytes:
        with _STORE_LOCK:
            if not self.store.check([key]):
                raise KeyError(key)
            return self.store.get(key)


def default_store() -> _LockedStore | None:
    """The default process group's store, shared with the heartbeat thread (None: no group)."""
    try:
        return _LockedStore(dist.distributed_c10d._get_default_store())
    except Exception:  # no default group (single process without init): no records to keep
        return None


def poll(store, keys: list[str], seconds: float) -> bool:
    """Whether every key exists within `seconds` (polled: a timed-out blocking wait can leave the
    store's client connection unusable for the reads that follow)."""
    deadline = time.monotonic() + seconds
    while True:
        if store.check(keys):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _fresh(age: float | None) -> bool:
    """Whether a heartbeat of this age (None: never written) comes from a live process."""
    return age is not None and age < _HEARTBEAT_STALE_S


class _Waiting:
    """`with watch.waiting(where)`: the heartbeat names `where` until the block ends."""

    __slots__ = ("watch", "where")

    def __init__(self, watch: "PeerWatch", where):
        self.watch, self.where = watch, where

    def __enter__(self) -> None:
        self.watch._waiting_at = self.where

    def __exit__(self, *exc) -> None:
        self.watch._waiting_at = None


class PeerWatch:
    """One schedule's heartbeat, progress records and stall reports, in the store under a
    namespace of its own. Without a store (no process group, or the tags off) it records nothing
    and names no one."""

    def __init__(self, enabled: bool = True):
        self.namespace = f"fsdp_ext/checks/{next(_NAMESPACES)}"
        self.store = default_store() if enabled else None
        # The collective this rank is blocked on, if any: whatever names it with `str()` (it
        # is formatted by the heartbeat, not at each wait).
        self._waiting_at = None
        if self.store is not None:
            self.beat()  # at once: a rank may fail before the thread's first beat
            _HEARTBEAT.add(self)

    def waiting(self, where) -> _Waiting:
        """A context in which this rank is blocked on the collective `str(where)` names."""
        return _Waiting(self, where)

    # ---- progress records -------------------------------------------------------------------------
    def record(self, iteration: int, where: str, last) -> None:
        """This rank's progress: `where` it is in `iteration`, and the `last` collective it
        issued (read by the peers' stall reports)."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.namespace}/progress/{dist.get_rank()}",
                           f"iteration {iteration}: {where} (the last collective it had issued "
                           f"then: {last})")
        except Exception:  # the store lives on rank 0: if it is gone the collectives say so
            self.store = None

    def _read_progress(self, rank: int) -> str:
        try:
            return self.store.get(f"{self.namespace}/progress/{rank}").decode()
        except Exception:
            return "none (it never started an iteration, or the store is gone)"

    # ---- records the members exchange ---------------------------------------------------------
    def accounts(self, topic: str, ranks: list[int], mine: str) -> dict[int, str]:
        """Write this rank's account under `topic`; read the other members' (each waited for up
        to STORE_WAIT_S); the ranks that never wrote one are missing from the result."""
        prefix = f"{self.namespace}/{topic}"
        me = dist.get_rank()
        found = {me: mine}
        if self.store is None:
            return found
        try:
            self.store.set(f"{prefix}/{me}", mine)
            for r in ranks:
                if r != me and poll(self.store, [f"{prefix}/{r}"], STORE_WAIT_S):
                    found[r] = self.store.get(f"{prefix}/{r}").decode()
        except Exception:  # a rank that never wrote: the caller says so
            pass
        self._linger(f"{prefix}/read", [r for r in ranks if r != me], STORE_WAIT_S)
        return found

    def _linger(self, prefix: str, readers: list[int], seconds: float) -> None:
        """Say this rank has read the records (`prefix`/rank) and stay until `readers` have too,
        for up to `seconds`: the store lives in rank 0's process, which may exit as soon as it
        raises."""
        if self.store is None:
            return
        try:
            self.store.set(f"{prefix}/{dist.get_rank()}", "1")
            poll(self.store, [f"{prefix}/{r}" for r in readers], seconds)
        except Exception:
            pass

    # ---- stalls -------------------------------------------------------------------------------------
    def report_stalled(self, ranks: list[int], where: str, timeout: datetime.timedelta | None,
                       exc: Exception, verb: str = "reach") -> None:
        """Raise CollectiveError: the collective `where` over `ranks` did not arrive (timeout) or
        a peer's connection broke. Each member's heartbeat (the store, refreshed every half second
        by a thread) says whether it is waiting on a collective too, alive in its own code, or
        gone; the ones not waiting are named, with their last progress record."""
        me = dist.get_rank()
        self._waiting_at = where
        self.beat()
        states: dict[int, tuple[float | None, str]] = {}
        deadline = time.monotonic() + _HEARTBEAT_GRACE_S
        while self.store is not None:
            states = {r: self._read_beat(r) for r in ranks if r != me}
            # A fresh beat may be about to change: a running peer may be about to wait, and one
            # whose beat names another collective may have just exited after it (its last beat
            # still says where it waited). Give them the grace period: a live peer keeps beating,
            # a gone one's beat goes stale.
            if time.monotonic() >= deadline or not any(
                    _fresh(age) and state != where for age, state in states.values()):
                break
            time.sleep(0.2)
        lines, behind = [], []
        for r in ranks:
            if r == me:
                lines.append(f"  rank {r}: waiting at {where}")
                continue
            age, state = states.get(r, (None, "running"))
            if state != "running" and _fresh(age):
                lines.append(f"  rank {r}: waiting at {state}")
                continue
            behind.append(r)
            last_beat = f"; its last beat: waiting at {state}" if state != "running" else ""
            gone = ("alive, in its own code (not waiting on a collective)" if _fresh(age) else
                    f"gone: no heartbeat for {age:.0f} s (exited or died{last_beat})"
                    if age is not None
                    else "gone: no heartbeat (or the store in rank 0's process is gone)")
            lines.append(f"  rank {r}: {gone}; last record: {self._read_progress(r)}")
        self._linger(f"{self.namespace}/read/{'-'.join(map(str, ranks))}",
                     [r for r in ranks if r != me and r not in behind], _HEARTBEAT_GRACE_S)
        timed_out = "timed out" in str(exc).lower()
        bound = (f" within {timeout.total_seconds():g} s" if timed_out and timeout is not None
                 else "" if timed_out else " (a peer's connection broke)")
        who = f"rank(s) {behind} stopped issuing collectives" if behind else \
            "every rank is waiting (a collective was lost)"
        raise CollectiveError(
            f"rank {me}: peers did not {verb} {where}{bound}; {who} (stuck, dead, or "
            f"done with their collectives): {exc}\n" + "\n".join(lines)) from exc

    # ---- heartbeat --------------------------------------------------------------------------------
    def beat(self) -> None:
        """Publish whether this rank is waiting on a collective (and which) or running."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.namespace}/beat/{dist.get_rank()}",
                           f"{time.time():.3f}|{self._waiting_at or 'running'}")
        except Exception:
            self.store = None

    def _read_beat(self, rank: int) -> tuple[float | None, str]:
        try:
            when, state = self.store.get(f"{self.namespace}/beat/{rank}").decode().split("|", 1)
            return time.time() - float(when), state
        except Exception:
            return None, "running"


class _Heartbeat:
    """One daemon thread per process refreshing every live watch's heartbeat."""

    def __init__(self):
        self.watches: weakref.WeakSet = weakref.WeakSet()
        self.thread: threading.Thread | None = None

    def add(self, watch: PeerWatch) -> None:
        self.watches.add(watch)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="fsdp_ext-heartbeat",
                                           daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(_HEARTBEAT_PERIOD_S)
            for watch in list(self.watches):
                watch.beat()


_HEARTBEAT = _Heartbeat()
