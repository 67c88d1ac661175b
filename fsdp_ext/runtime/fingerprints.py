"""Collective tags: every collective the runtime issues is checked, every step, before its data is
used, and a rank that diverges or stops is named.

Each all-gather, reduce-scatter and (HSDP) all-reduce is issued together with a tag exchange: a
64-bit hash of (kind, unit, the buckets' sizes and dtypes, its sequence number on that process
group), all-gathered asynchronously on the same group just before the data collective,
in the same order (the same stream on accelerators). Nothing waits for it at issue time. Where the
data is waited for (`comm.Pending.wait`), the tag is waited for first and compared: if any rank
sent another tag (it skipped or reordered a unit, ran an extra micro-batch, left the loop), every
rank raises CollectiveMismatchError before touching the data, even when the two collectives had
the same size and their bytes were silently exchanged. Each rank then writes what it was doing to
the process group's store and reads the others' (bounded), so the error names, for every rank, the
collective it was at. See [Note: tags beside the data] for why the tag is a collective of its own.

Every wait is bounded (comm.collective_timeout: 300 s by default, well under the process group's
own timeout). When a tag does not arrive in time, each rank reads the others' progress records
(written to the store twice per iteration, one forward of the root: as it starts and at the end
of backward) and raises
CollectiveError naming the ranks that are behind and where they last were.

`FSDP_EXT_CHECK=off` turns the tags off; it exists to measure what they cost (docs/benchmarks.md).
After a CollectiveMismatchError the process group may hold mismatched collectives in flight: the
run cannot go on (as after any collective failure); end it.

[Note: tags beside the data]
The tags could ride inside the data buffers (a tail per rank's slot), saving the tiny collective.
fsdp_ext gathers large parameters directly into their places (layout.py), gloo's CPU all-gather is
one broadcast per rank straight into the gathered buffer, and the reduce-scatter's sum would need
tags that survive a SUM in bf16: every one of those buffers would need a tail, the kernels and
views an offset, and a tag in a bf16 reduction is exact only for small integers. A separate
8-byte-per-rank all-gather, issued asynchronously right before the data on the same group, keeps
every data path as it is and costs what the benchmark measures; it is verified before the data is
used, which is what makes silent mixing impossible.
"""
from __future__ import annotations

import collections
import datetime
import hashlib
import itertools
import os
import time

import torch
import torch.distributed as dist

from . import streams
from .errors import CollectiveError, CollectiveMismatchError

CHECK_ENV = "FSDP_EXT_CHECK"
_NAMESPACES = itertools.count()  # checkers made in this process, in the same order on every rank
_STORE_WAIT_S = 10.0  # how long to wait for the other ranks' records after a failure
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def checks_enabled() -> bool:
    return os.environ.get(CHECK_ENV, "on").lower() not in ("off", "0", "false")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _poll(store, keys: list[str], seconds: float) -> bool:
    """Whether every key exists within `seconds` (polled: a timed-out blocking wait can leave the
    store's client connection unusable for the reads that follow)."""
    deadline = time.monotonic() + seconds
    while True:
        if store.check(keys):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group (single process without init): no records to keep
        return None


class Tag:
    """One tag exchange in flight; `verify()` before the data it stands for is used."""

    def __init__(self, checker: "CollectiveChecker", group, key: str, sequence: int,
                 description: str, mine: torch.Tensor, everyone: torch.Tensor, work, event):
        self.checker, self.group, self.key, self.sequence = checker, group, key, sequence
        self.description = description
        self.mine, self.everyone, self.work, self.event = mine, everyone, work, event
        self.checked = False

    def verify(self, timeout: datetime.timedelta | None) -> None:
        """Check this tag and every earlier one of its group not checked yet, in issue order: the
        first mismatched exchange is the one every rank reports (a rank that stopped there issues
        nothing later that the others could wait for)."""
        queue = self.checker.outstanding.get(self.key)
        while queue and not self.checked:
            queue.popleft()._check(timeout)

    def _check(self, timeout: datetime.timedelta | None) -> None:
        self.checked = True
        try:
            if self.work is not None:
                if timeout is None:
                    self.work.wait()
                else:
                    self.work.wait(timeout)
            if self.event is not None:  # on the collective's stream: the host reads the tags
                streams.synchronize(self.event)
        except Exception as exc:
            self.checker.report_stalled(self, timeout, exc)
        everyone = self.everyone.tolist()
        if all(t == everyone[0] for t in everyone):
            return
        self.checker.report_mismatch(self)


class CollectiveChecker:
    """Issues the tags of one schedule's collectives and names divergent or stalled ranks."""

    def __init__(self, device: torch.device, timeout: datetime.timedelta | None = None,
                 side_streams: bool = False):
        self.device = device
        self.timeout = timeout
        self.side_streams = side_streams
        self.enabled = checks_enabled()
        self.namespace = f"fsdp_ext/checks/{next(_NAMESPACES)}"
        self.step = 0
        self.sequences: dict[str, int] = {}
        self.outstanding: dict[str, collections.deque] = {}  # per group: tags not checked yet
        self.last = "nothing yet"  # the last collective this rank issued, for progress records
        self.store = _store() if self.enabled else None

    # ---- progress records -------------------------------------------------------------------------
    def _record(self, where: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(f"{self.namespace}/progress/{dist.get_rank()}",
                           f"iteration {self.step}: {where} (the last collective it had issued then: "
                           f"{self.last})")
        except Exception:  # the store lives on rank 0: if it is gone the collectives say so
            self.store = None

    def next_iteration(self) -> None:
        self.step += 1
        self._record("forward started")

    def backward_finished(self) -> None:
        self._record("backward finished")

    # ---- tags ---------------------------------------------------------------------------------------
    def issue(self, group, kind: str, unit: str, sizes: list[tuple[int, torch.dtype]],
              phase: str) -> Tag | None:
        """Start the tag exchange of the collective about to be issued on `group` (call it right
        before the data collective, on the same stream)."""
        if group is None or not self.enabled:
            return None
        ranks = dist.get_process_group_ranks(group)
        key = "-".join(map(str, ranks))
        sequence = self.sequences.get(key, 0) + 1
        self.sequences[key] = sequence
        shape = ", ".join(f"{n} x {str(d).replace('torch.', '')}" for n, d in sizes)
        what = f"{kind} #{sequence} of unit '{unit or '<root>'}' ({shape})"
        self.last = f"{what}, {phase}"
        description = f"{what}, {phase}, iteration {self.step}"
        # Not the iteration: a forward that issues nothing (every unit already gathered) on one
        # rank would shift it without any divergence in the collectives themselves.
        mine = torch.tensor([_hash(what)], dtype=torch.int64, device=self.device)
        everyone = torch.empty(len(ranks), dtype=torch.int64, device=self.device)
        if self.side_streams:
            _all_gather_flat(everyone, mine, group=group, async_op=False)
            tag = Tag(self, group, key, sequence, description, mine, everyone, None,
                      streams.record_event(streams.current_stream(self.device)))
        else:
            work = _all_gather_flat(everyone, mine, group=group, async_op=True)
            tag = Tag(self, group, key, sequence, description, mine, everyone, work, None)
        self.outstanding.setdefault(key, collections.deque()).append(tag)
        return tag

    # ---- reports ------------------------------------------------------------------------------------
    def _exchange(self, tag: Tag, mine: str) -> dict[int, str]:
        """Write this rank's account of the mismatched collective; read the other members'."""
        ranks = dist.get_process_group_ranks(tag.group)
        prefix = f"{self.namespace}/mismatch/{tag.key}/{tag.sequence}"
        accounts = {dist.get_rank(): mine}
        if self.store is None:
            return accounts
        try:
            self.store.set(f"{prefix}/{dist.get_rank()}", mine)
            for r in ranks:
                if r != dist.get_rank() and _poll(self.store, [f"{prefix}/{r}"], _STORE_WAIT_S):
                    accounts[r] = self.store.get(f"{prefix}/{r}").decode()
            # Stay until the others have read too: the store lives in rank 0's process, which
            # may exit as soon as it raises.
            self.store.set(f"{prefix}/read/{dist.get_rank()}", "1")
            _poll(self.store, [f"{prefix}/read/{r}" for r in ranks if r != dist.get_rank()],
                  _STORE_WAIT_S)
        except Exception:  # a rank that never wrote: say so below
            pass
        return accounts

    def report_mismatch(self, tag: Tag) -> None:
        ranks = dist.get_process_group_ranks(tag.group)
        accounts = self._exchange(tag, tag.description)
        lines = [f"  rank {r}: {accounts.get(r, '(no account: it did not reach this check)')}"
                 for r in ranks]
        counts = collections.Counter(accounts.values())
        common, n = counts.most_common(1)[0]
        odd = [r for r in ranks if accounts.get(r) != common]
        who = f"; rank(s) {odd} differ from the other {n}" if n > len(ranks) - n else ""
        raise CollectiveMismatchError(
            f"rank {dist.get_rank()}: ranks diverged at collective #{tag.sequence} on group "
            f"{ranks}{who} (a rank skipped, added or reordered a unit, e.g. in a data-dependent "
            "branch, an extra micro-batch, or a loop that ended early); no data from it was "
            "used:\n" + "\n".join(lines))

    def report_stalled(self, tag: Tag, timeout, exc: Exception, verb: str = "reach") -> None:
        """The tag did not arrive (timeout) or a peer's connection broke. Every rank that ends up
        here says what it is waiting for; a member that does not within a short grace is behind
        (stuck in its own code, dead, or done with its collectives), and its last progress
        record says where it was."""
        ranks = dist.get_process_group_ranks(tag.group)
        me = dist.get_rank()
        prefix = f"{self.namespace}/waiting/{tag.key}"
        waiting, progress = {me: tag.description}, {}
        if self.store is not None:
            try:
                self.store.set(f"{prefix}/{me}", tag.description)
            except Exception:
                self.store = None
        deadline = time.monotonic() + _STORE_WAIT_S
        for r in ranks:
            if r == me or self.store is None:
                continue
            try:
                left = max(0.1, deadline - time.monotonic())
                if not _poll(self.store, [f"{prefix}/{r}"], left):
                    raise LookupError
                waiting[r] = self.store.get(f"{prefix}/{r}").decode()
            except Exception:
                try:
                    progress[r] = self.store.get(f"{self.namespace}/progress/{r}").decode()
                except Exception:
                    progress[r] = "no progress record (it never started an iteration, or the " \
                                  "store, which lives in rank 0's process, is gone)"
        if self.store is not None:  # stay until the other waiting ranks have read (see _exchange)
            try:
                self.store.set(f"{prefix}/read/{me}", "1")
                _poll(self.store, [f"{prefix}/read/{r}" for r in waiting if r != me],
                      max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
        behind = sorted(progress)
        lines = [f"  rank {r}: waiting at {waiting[r]}" if r in waiting else
                 f"  rank {r}: not waiting on this group; last record: {progress.get(r, '?')}"
                 for r in ranks]
        timed_out = "timed out" in str(exc).lower()
        bound = (f" within {timeout.total_seconds():g} s" if timed_out and timeout is not None
                 else "" if timed_out else " (a peer's connection broke)")
        who = f"rank(s) {behind} stopped issuing collectives" if behind else \
            "every rank is waiting (a collective was lost)"
        raise CollectiveError(
            f"rank {me}: peers did not {verb} {tag.description}{bound}; {who} (stuck, dead, or "
            f"done with their collectives): {exc}\n" + "\n".join(lines)) from exc
