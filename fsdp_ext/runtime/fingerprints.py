"""Collective fingerprints: turn a would-be deadlock into an error that names where ranks diverged.

Before each all-gather / reduce-scatter / all-reduce, ranks all-gather a 64-bit hash of what they
are about to issue (sequence number, kind, unit, bucket, numel, dtype). If one rank skipped a unit
(a data-dependent branch, say) the hashes differ at the first divergent call, and every rank raises
CollectiveMismatchError listing what each rank was about to do, instead of blocking forever in
mismatched collectives. The check costs one tiny all-gather per collective, so by default it runs for
the first `FSDP_EXT_CHECK_ITERATIONS` (default 2) iterations only; set it to -1 to keep it on, 0 to
turn it off.
"""
from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist

from .errors import CollectiveError, CollectiveMismatchError


def default_check_iterations() -> int:
    return int(os.environ.get("FSDP_EXT_CHECK_ITERATIONS", "2"))


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


class CollectiveChecker:
    def __init__(self, device: torch.device, iterations: int | None = None, timeout=None):
        self.device = device
        self.timeout = timeout  # datetime.timedelta | None: bound on the fingerprint exchange
        self.iterations = default_check_iterations() if iterations is None else iterations
        self.iteration = 0
        self.sequence = 0

    @property
    def active(self) -> bool:
        return self.iterations < 0 or self.iteration <= self.iterations

    def next_iteration(self) -> None:
        self.iteration += 1

    def check(self, group, kind: str, unit: str, bucket: int, numel: int, dtype) -> None:
        """Compare what this rank is about to issue on `group` with every other member."""
        if group is None or not self.active:
            return
        self.sequence += 1
        fingerprint = (f"call #{self.sequence}: {kind} of unit '{unit or '<root>'}' bucket {bucket} "
                       f"({numel} x {dtype})")
        world = dist.get_world_size(group)
        mine = torch.tensor([_hash(fingerprint)], dtype=torch.int64, device=self.device)
        everyone = torch.empty(world, dtype=torch.int64, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        # This exchange is where a rank waits for a peer that is stuck, dead or in another branch
        # that issues no collective at all: bound it and name what this rank was about to do.
        try:
            work = gather(everyone, mine, group=group, async_op=True)
            if self.timeout is None:
                work.wait()
            else:
                work.wait(self.timeout)
        except Exception as exc:
            bound = f" within {self.timeout.total_seconds():g} s" if self.timeout else ""
            raise CollectiveError(
                f"rank {dist.get_rank()}: peers did not reach {fingerprint}{bound} (a rank is "
                f"stuck, died, or skipped every remaining collective): {exc}") from exc
        if bool((everyone == mine).all()):
            return
        descriptions: list[str | None] = [None] * world
        dist.all_gather_object(descriptions, fingerprint, group=group)
        ranks = dist.get_process_group_ranks(group)
        lines = [f"  rank {r}: {d}" for r, d in zip(ranks, descriptions)]
        raise CollectiveMismatchError(
            f"rank {dist.get_rank()}: ranks diverged before a collective (a rank skipped or reordered "
            f"a unit, e.g. in a data-dependent branch, or units differ between ranks):\n"
            + "\n".join(lines))
