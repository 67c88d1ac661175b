"""collective_tags.read_flags on the accelerator path, in one process: the step's tag flags are
copied to pinned host memory without waiting, and read once. A model device below holds those
copies back until told, so a copy can land after the host's bounded wait gave up."""
from __future__ import annotations

import datetime

import pytest
import torch

from fsdp_ext.runtime.comm import collective_tags
from fsdp_ext.runtime.core import streams
from fsdp_ext.runtime.core.errors import CollectiveError, CollectiveMismatchError


class _LateDevice(streams.DeviceStreams):
    """Side streams on CPU whose device-to-host flag copies land only when `land()` runs (or
    when the host waits for them, if `stalled` is False)."""

    def __init__(self):
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.stalled = True

    def side_streams(self, device):
        return True

    def current_stream(self, device):
        return "compute"

    def record_event(self, stream):
        return "event"

    def wait_event(self, stream, event):
        pass

    def query(self, event):
        if not self.stalled:
            self.land()
        return not self.queued

    def synchronize(self, event):
        self.land()

    def host_empty(self, shape, dtype, pin):
        return torch.empty(shape, dtype=dtype)

    def land(self):
        for target, value in self.queued:
            target.copy_(value)
        self.queued.clear()


@pytest.fixture
def checker(monkeypatch):
    device = _LateDevice()

    def compare(tag):  # Tag.compare, its copy queued on the model device
        tag.bad = tag.everyone.ne(tag.everyone[0]).sum()
        device.queued.append((tag.checker.flag_slot(tag.slot), tag.bad))
        tag.checked = True

    def stalled(ranks, where, timeout, exc, verb="reach"):
        raise CollectiveError(f"peers did not {verb} {where}: {exc}")

    def mismatch(tag):
        raise CollectiveMismatchError(f"ranks diverged at {tag.description}")
    monkeypatch.setattr(collective_tags.Tag, "compare", compare)
    monkeypatch.setattr(collective_tags.dist, "get_process_group_ranks", lambda group: [0, 1])
    with streams.backend_installed(device):
        checker = collective_tags.CollectiveChecker(
            torch.device("cpu"), datetime.timedelta(milliseconds=20), side_streams=True)
        monkeypatch.setattr(checker.watch, "report_stalled", stalled)
        monkeypatch.setattr(checker, "report_mismatch", mismatch)
        checker.device_model = device
        yield checker


def _step(checker, tags: list[int]) -> None:
    """A step whose all-gathers exchanged `tags` (rank 0's, rank 1's), then its flags read."""
    checker.next_iteration()
    tag = checker.issue("group", "all_gather", "blocks.0", [(4, torch.float32)], "forward")
    tag.everyone.copy_(torch.tensor(tags))
    checker.read_flags()


def test_late_flag_copies_after_a_timed_out_read_never_reach_a_later_step(checker):
    """Step 1 diverged, but its flag's copy had not landed when the wait timed out (the stall is
    reported); the copy lands afterwards. Step 2 agrees and stalls too: its report must be the
    stall, not step 1's mismatch read from a reused slot. Then a step whose copies land passes."""
    device = checker.device_model
    with pytest.raises(CollectiveError, match="did not finish"):
        _step(checker, [1, 2])
    device.land()  # step 1's copy, after the host gave up on it
    with pytest.raises(CollectiveError, match="did not finish"):
        _step(checker, [3, 3])
    device.land()
    device.stalled = False
    _step(checker, [4, 4])
    with pytest.raises(CollectiveMismatchError, match="all_gather #4"):
        _step(checker, [5, 6])
