"""Collective tags: every collective the runtime issues is checked, every step, before its data is
used, and a rank that diverges is named.

Each all-gather, reduce-scatter and (HSDP) all-reduce is issued together with a tag exchange: a
64-bit hash of (kind, unit, the buckets' sizes and dtypes, its sequence number on that process
group), all-gathered asynchronously on the same group just before the data collective, in the same
order (the same stream on accelerators). Nothing waits for it at issue time. Where the data is
waited for (`comm.Pending.wait`), the tag is checked: if any rank sent another tag (it skipped or
reordered a unit, ran an extra micro-batch, left the loop), every rank raises
CollectiveMismatchError, even when the two collectives had the same size and their bytes were
silently exchanged: on CPU ranks before touching the data, on accelerators at the end of the step's
backward, before the optimizer step ([Note: checking on the device]). Each rank then writes what it
was doing to the process group's store and reads the others' (bounded), so the error names, for
every rank, the collective it was at. Why the tag is a collective of its own: docs/diagnostics.md,
"Tags beside the data". A rank whose peers stopped issuing collectives is named by the peer watch
(peer_watch.py): the tags tell it which collective this rank waits on.

`FSDP_EXT_CHECK=off` (fsdp_ext/env.py) turns the tags off; it exists to measure what they cost
(docs/benchmarks.md). `FSDP_EXT_CHECK=sync` checks every tag on the host where its data is waited
for, on accelerators too (the earliest error, at the price of the host syncs below). After a
CollectiveMismatchError the process group may hold mismatched collectives in flight: the run cannot
go on (as after any collective failure); end it.

[Note: checking on the device]
On CPU ranks the host compares the gathered tags where the data is waited for: that wait is the
host's anyway. On an accelerator a host compare would block the host at every collective (a
device-to-host copy of the tags waits for everything queued before it), so the host could never run
more than one unit ahead of the device. There the tag is made by a fill kernel (no host copy),
compared on the compute stream where the data is waited for (`Tag.compare`: one flag per exchange,
no sync), and the flags of a step are copied to pinned host memory and read once, by `read_flags`
at the end of backward (or of a forward without gradients): one bounded host sync per step. A
mismatch then raises on every rank of the group before the optimizer step; the mismatched data may
have fed that step's forward and backward, whose results the error discards. A stalled peer
surfaces there too, within the collective timeout (or earlier, at a host sync of the user's own,
such as `loss.item()`, which the process group's watchdog bounds).
"""
from __future__ import annotations

import collections
import datetime
import hashlib
import time

import torch
import torch.distributed as dist

from ..core import streams
from .collectives import all_gather_flat, wait_work
from ..core.errors import CollectiveMismatchError
from ..core.host_reads import wait_bounded
from .peer_watch import PeerWatch

_FLAGS_PER_BUFFER = 256  # tag flags per pinned host buffer (a step of a 40-unit model needs ~120)


class _Collective:
    """What the tags of one (kind, unit, sizes) share, made once and kept by the checker: a tag is
    made at every collective (benchmarks/host/tag_cost.py measures its host cost).

    Its `n`-th collective is named "{kind} #{n} of unit '{unit}' ({sizes})" and hashed from that
    text: the hash's state after "{kind} #" is kept, and only the number and the rest are fed to
    a copy of it (the same digest as hashing the whole text). A tag's description is formatted
    only when a heartbeat, a record or an error prints it."""

    __slots__ = ("kind", "rest", "_rest_bytes", "_hash_head")

    def __init__(self, kind: str, unit: str, sizes: list[tuple[int, torch.dtype]]):
        shape = ", ".join(f"{n} x {str(d).replace('torch.', '')}" for n, d in sizes)
        self.kind, self.rest = kind, f" of unit '{unit or '<root>'}' ({shape})"
        self._rest_bytes = self.rest.encode()
        self._hash_head = hashlib.blake2b(f"{kind} #".encode(), digest_size=7)

    def what(self, sequence: int) -> str:
        return f"{self.kind} #{sequence}{self.rest}"

    def value(self, sequence: int) -> int:
        """The 56-bit hash of `what(sequence)`."""
        digest = self._hash_head.copy()
        digest.update(b"%d" % sequence + self._rest_bytes)  # (one update: the same digest)
        return int.from_bytes(digest.digest(), "little")


class Tag:
    """One tag exchange: made by `CollectiveChecker.issue`, started by `exchange()` right before
    its data collective (on the same stream), checked before that data is used.

    Two ways to check (see [Note: checking on the device]): `verify()` on the host where the data
    is waited for (CPU ranks; `FSDP_EXT_CHECK=sync`), or `compare()` on the device where the data is
    waited for, into a flag that `CollectiveChecker.read_flags` reads once per step.

    What comm.py asks of it (comm.CollectiveCheck): `exchange()` at the launch; `before_wait`,
    `waiting`, `on_failure` and `after_wait` around the wait for the data."""

    __slots__ = ("checker", "group", "key", "sequence", "collective", "phase", "iteration",
                 "value", "on_device", "mine", "everyone", "work", "event", "bad", "slot",
                 "checked", "_description")

    def __init__(self, checker: "CollectiveChecker", group, key: str, sequence: int,
                 collective: _Collective, phase: str, size: int):
        self.checker, self.group, self.key, self.sequence = checker, group, key, sequence
        self.collective, self.phase, self.iteration = collective, phase, checker.step
        # Not the iteration: a forward that issues nothing (every unit already gathered) on one
        # rank would shift it without any divergence in the collectives themselves.
        self.value = collective.value(sequence)
        self.on_device = checker.on_device
        # Allocated on the stream that writes them (the collective's: comm.Streams.launch makes
        # tags there, after that stream's wait), read back on the compute stream after it waited
        # for the collective, then dropped: the writer's next allocation comes after its next
        # wait, which orders it after that read.
        self.mine = torch.empty(1, dtype=torch.int64, device=checker.device)
        self.everyone = torch.empty(size, dtype=torch.int64, device=checker.device)
        self.work = self.event = None
        self.bad: torch.Tensor | None = None  # on the device: how many ranks' tags differ
        self.slot, self.checked = -1, False   # slot: its flag's place in the pinned buffers
        self._description: str | None = None

    @property
    def description(self) -> str:
        """e.g. "all_gather #3 of unit 'blocks.0' (4096 x float32), forward, iteration 2"."""
        if self._description is None:
            self._description = (f"{self.collective.what(self.sequence)}, {self.phase}, "
                                 f"iteration {self.iteration}")
        return self._description

    def __str__(self) -> str:
        return self.description

    # ---- what comm.py calls ---------------------------------------------------------------------
    def exchange(self) -> "Tag":
        """All-gather the tag on the current stream. `fill_` takes the value as a kernel
        argument: nothing is copied from the host, nothing waits."""
        self.mine.fill_(self.value)
        if self.checker.side_streams:
            all_gather_flat(self.everyone, self.mine, group=self.group, async_op=False)
            self.event = streams.record_event(streams.current_stream(self.checker.device))
        else:
            self.work = all_gather_flat(self.everyone, self.mine, group=self.group, async_op=True)
        return self

    def before_wait(self, timeout: datetime.timedelta | None) -> None:
        """Before the host waits for the data: the host check, where tags are checked there."""
        if not self.on_device:
            self.verify(timeout)

    def waiting(self):
        """A context in which this rank is blocked on this tag's collective (its heartbeat says
        so, peer_watch.py)."""
        return self.checker.watch.waiting(self)

    def on_failure(self, exc: Exception, timeout: datetime.timedelta | None) -> None:
        """The wait for the data failed (`exc`: a timeout or a peer's broken connection): raise
        the CollectiveError naming the ranks that stopped issuing collectives."""
        self.checker.watch.report_stalled(dist.get_process_group_ranks(self.group),
                                          self.description, timeout, exc, verb="finish")

    def after_wait(self) -> None:
        """The current stream was ordered after the collective: compare on the device, where
        tags are checked there."""
        if self.on_device:
            self.compare()

    # ---- the checks -------------------------------------------------------------------------------
    def compare(self) -> None:
        """On the current stream, which must be ordered after the exchange: how many ranks sent
        another tag than the group's first, copied without waiting into this tag's slot of pinned
        host memory (read_flags reads it)."""
        self.bad = self.everyone.ne(self.everyone[0]).sum()
        self.checker.flag_slot(self.slot).copy_(self.bad, non_blocking=True)
        self.checked = True

    def verify(self, timeout: datetime.timedelta | None) -> None:
        """Check this tag and every earlier one of its group not checked yet, in issue order: the
        first mismatched exchange is the one every rank reports (a rank that stopped there issues
        nothing later that the others could wait for)."""
        queue = self.checker.outstanding.get(self.key)
        while queue and not self.checked:
            queue.popleft()._check(timeout)

    def _check(self, timeout: datetime.timedelta | None) -> None:
        self.checked = True
        with self.checker.watch.waiting(self):
            try:
                if self.work is not None:
                    wait_work(self.work, timeout)
                if self.event is not None:  # on the collective's stream: the host reads the tags
                    streams.synchronize(self.event)
            except Exception as exc:
                self.checker.watch.report_stalled(dist.get_process_group_ranks(self.group),
                                                  self.description, timeout, exc)
        everyone = self.everyone.tolist()
        if all(t == everyone[0] for t in everyone):
            return
        self.checker.report_mismatch(self)


class CollectiveChecker:
    """Issues the tags of one schedule's collectives and names divergent ranks (stalled ones:
    its peer watch)."""

    def __init__(self, device: torch.device, timeout: datetime.timedelta | None = None,
                 side_streams: bool = False, mode: str = "on"):
        """`mode`: FSDP_EXT_CHECK as fsdp_ext/env.py read it: "on", "off", or "sync" (every tag checked on
        the host where its data is waited for, also on accelerators)."""
        self.device, self.timeout, self.side_streams = device, timeout, side_streams
        self.enabled = mode != "off"
        # With side streams the host must not wait for the device at each collective.
        self.on_device = side_streams and mode == "on"
        self.step = 0
        self._read_since_forward = True  # read_flags ran since the last forward began
        self.sequences: dict[str, int] = {}
        self.outstanding: dict[str, collections.deque] = {}  # per group: tags not checked yet
        self.unread: list[Tag] = []  # on the device: tags since the last read_flags, issue order
        # Pinned host memory the compared flags are copied into, _FLAGS_PER_BUFFER a buffer, kept
        # and reused once read_flags waited for their copies (dropped if that wait timed out).
        self._flag_buffers: list[torch.Tensor] = []
        self._group_keys: dict[int, tuple] = {}  # id(group) -> (key, size, group)
        self._collectives: dict[tuple, _Collective] = {}  # (kind, unit, sizes) -> shared parts
        self._last: tuple[_Collective, int, str] | None = None  # the last issued, for records
        self.watch = PeerWatch(self.enabled)

    # ---- progress records -------------------------------------------------------------------------
    def _record(self, where: str) -> None:
        if self._last is None:
            last = "nothing yet"
        else:
            collective, sequence, phase = self._last
            last = f"{collective.what(sequence)}, {phase}"
        self.watch.record(self.step, where, last)

    def next_iteration(self, micro_batches_in_flight: bool = False) -> None:
        """A root forward starts. The tags of a forward with gradients whose backward never ran
        are read now, unless the previous forward's backward is still to come
        (`micro_batches_in_flight`: a pipeline schedule runs several micro-batches' forwards
        before their backwards, and reads every tag once at the step's end)."""
        if not self._read_since_forward and not micro_batches_in_flight:
            self.read_flags()
        self._read_since_forward = False
        self.step += 1
        self._record("forward started")

    def backward_finished(self) -> None:
        self._record("backward finished")

    # ---- tags ---------------------------------------------------------------------------------------
    def issue(self, group, kind: str, unit: str, sizes: list[tuple[int, torch.dtype]],
              phase: str) -> Tag | None:
        """The tag of the collective about to be issued on `group`; `exchange()` it right before
        the data collective, on the same stream."""
        if group is None or not self.enabled:
            return None
        if (known := self._group_keys.get(id(group))) is None:  # the group stays referenced
            ranks = dist.get_process_group_ranks(group)
            known = self._group_keys[id(group)] = ("-".join(map(str, ranks)), len(ranks), group)
        key, size, _ = known
        sequence = self.sequences.get(key, 0) + 1
        self.sequences[key] = sequence
        shared = (kind, unit, *sizes)
        if (collective := self._collectives.get(shared)) is None:
            collective = self._collectives[shared] = _Collective(kind, unit, sizes)
        self._last = (collective, sequence, phase)
        tag = Tag(self, group, key, sequence, collective, phase, size)
        if tag.on_device:
            tag.slot = len(self.unread)
            self.unread.append(tag)
        elif (queue := self.outstanding.get(key)) is not None:
            queue.append(tag)
        else:
            self.outstanding[key] = collections.deque([tag])
        return tag

    def flag_slot(self, slot: int) -> torch.Tensor:
        """The 0-dim pinned host tensor a tag's flag is copied into (-1 until it arrives)."""
        index, offset = divmod(slot, _FLAGS_PER_BUFFER)
        while len(self._flag_buffers) <= index:
            buffer = streams.host_empty(_FLAGS_PER_BUFFER, torch.int64, pin=True)
            self._flag_buffers.append(buffer.fill_(-1))
        return self._flag_buffers[index][offset]

    def _flags(self, count: int, copies_done: bool = True) -> list[int]:
        """The first `count` flags as the host sees them now, their slots reset for reuse; unless
        their copies may still land (a timed-out wait): then later steps get fresh buffers,
        where no late copy can pass for their flag (the pinned allocator keeps a freed block
        until the copies recorded on it are done)."""
        values = []
        for index in range((count + _FLAGS_PER_BUFFER - 1) // _FLAGS_PER_BUFFER):
            values += self._flag_buffers[index][:count - index * _FLAGS_PER_BUFFER].tolist()
        if not copies_done:
            self._flag_buffers = []
        for buffer in self._flag_buffers:  # (also any a longer step used: 256 values each)
            buffer.fill_(-1)
        return values

    def defer_flags(self) -> None:
        """A backward that reduced no gradient ended (a no_sync micro-batch): its tags are read
        with the next read_flags, at the end of the backward that reduces them, before the
        optimizer step that would use them."""
        self._read_since_forward = True

    def read_flags(self) -> bool:
        """On the device: the one host sync of a step (the end of backward; the end of a forward
        without gradients; else the next forward). Compares the tags whose data nobody waited for
        (after their exchange only: the data may still be in flight), then waits, bounded, until
        every flag reached pinned host memory; a mismatch raises on every rank of the group, before
        an optimizer step can use the data. When the wait times out, the flags that did arrive
        still name a mismatch (a divergent rank's extra collective stalls the others' streams)."""
        self._read_since_forward = True
        tags, self.unread = self.unread, []
        if not tags:
            return False
        current = streams.current_stream(self.device)
        for tag in tags:
            if tag.bad is None:
                if tag.event is not None:
                    streams.wait_event(current, tag.event)
                tag.compare()
        copied = streams.record_event(current)
        with self.watch.waiting(tags[-1]):
            try:
                wait_bounded(copied, self.timeout)
            except Exception as exc:
                arrived = self._flags(len(tags), copies_done=False)  # what landed so far
                for tag, bad in zip(tags, arrived):
                    if bad > 0:
                        self.report_mismatch(tag)
                self.watch.report_stalled(dist.get_process_group_ranks(tags[-1].group),
                                          tags[-1].description, self.timeout, exc, verb="finish")
        for tag, bad in zip(tags, self._flags(len(tags))):
            if bad > 0:
                self.report_mismatch(tag)
        return True

    # ---- reports ------------------------------------------------------------------------------------
    def report_mismatch(self, tag: Tag) -> None:
        """Raise CollectiveMismatchError naming, for every member of the tag's group, the
        collective it was at (their accounts, exchanged through the store)."""
        ranks = dist.get_process_group_ranks(tag.group)
        accounts = self.watch.accounts(f"mismatch/{tag.key}/{tag.sequence}", ranks,
                                       tag.description)
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
