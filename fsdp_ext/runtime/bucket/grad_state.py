"""What a bucket's gradient path keeps across micro-batches (bucket.py owns one; grads.py uses it
through these methods only)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class BucketGrads:
    """Per-bucket gradient state that lives across micro-batches."""

    unsharded_accumulator: torch.Tensor | None = None   # [W * S] reduce dtype, no_sync
    used: list[bool] = field(default_factory=list)      # got a gradient since the last sync
    ran: list[bool] = field(default_factory=list)       # its module ran since the last sync
    nonfinite: torch.Tensor | None = None                # check_finite_grads: flags since sync
    # HSDP under set_requires_all_reduce(False): the reduce-scattered (not yet all-reduced) sum
    # per gather group, added to the next reduction that all-reduces (as torch's FSDP2 does)
    partial_reduce: list[torch.Tensor] | None = None

    def note_used(self, used: list[bool]) -> None:
        """OR one backward use's "got a gradient" flags into those since the last sync."""
        self.used = [a or b for a, b in zip(self.used, used)] if self.used else used

    def note_ran(self, ran: list[bool]) -> None:
        """OR one use's "its module ran" flags (a list unit's members) into those since sync."""
        self.ran = [a or b for a, b in zip(self.ran, ran)] if self.ran else ran

    def merge_nonfinite(self, flags: torch.Tensor) -> None:
        self.nonfinite = flags

    def accumulate_unsharded(self, flat: torch.Tensor) -> None:
        """no_sync: add a packed, pre-divided gradient to the unsharded accumulator."""
        if self.unsharded_accumulator is None:
            self.unsharded_accumulator = flat
        else:
            self.unsharded_accumulator.add_(flat)

    def take_for_sync(self):
        """What a synchronised reduction takes over (and this state forgets): (the no_sync
        accumulator, the HSDP partial sums, the used flags, the non-finite flags, the ran flags:
        empty when every module ran)."""
        taken = (self.unsharded_accumulator, self.partial_reduce, self.used, self.nonfinite,
                 self.ran)
        self.unsharded_accumulator = self.partial_reduce = self.nonfinite = None
        self.used, self.ran = [], []
        return taken

    def keep_partial(self, partial: list[torch.Tensor]) -> None:
        """HSDP with the all-reduce deferred: the sum waits for a later reduction."""
        self.partial_reduce = partial
