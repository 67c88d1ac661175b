"""A unit's forward uses whose backward has not run yet, so that a unit used k times in one
forward (a shared embedding, multi-token prediction's output head) is reduced once per backward.

Every use installs its own `_UnshardedViews` (unit_params.py), whose backward brings that use's
gradients. When another use's views will still run in the same backward (autograd's engine says
so: `torch._C._will_engine_execute_node`), the gradients are summed here instead of reduced: in
the parameter dtype and in arrival order, as autograd accumulates a parameter used twice, and as
torch's FSDP2 then reduce-scatters that sum once. The last use to run hands the sum on. Uses in
different backwards (micro-batches, the chunks of a chunked loss) are reduced in each.

Each use also says which of a list unit's members ran in it (`ran`: their ids; None for a
single module, which always runs whole): a member that did not run got no gradient on any rank,
so its parameters need not be sent (grads.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Arrived:
    """What one or more uses of a unit in one backward bring to its gradient path."""

    grads: tuple                 # per trainable parameter, None where no use gave a gradient
    ran: frozenset | None        # ids of the members that ran in them; None: every member


class BackwardUses:
    def __init__(self) -> None:
        self._waiting: list = []   # (autograd node, the members' ids it ran: a live set or None)
        self._sum: Arrived | None = None  # what the uses that already ran brought, summed

    def add(self, node, ran: set | None) -> None:
        """A forward use installed views whose backward is `node`; `ran` fills as members run."""
        self._waiting.append((node, ran))

    def arrived(self, node, grads: tuple, held: tuple | None = None) -> Arrived | None:
        """Use `node`'s gradients: what to reduce now (with the earlier uses' sum), or None when
        a later use in this backward will bring the rest. `held`: gradients already summed in
        the parameter dtype for this step (pipelining's weight passes), which these add to."""
        if held is not None:
            grads = tuple(add_grads(h, g) for h, g in zip(held, grads))
        ran = None
        for i, (waiting, members) in enumerate(self._waiting):
            if waiting is node:
                ran = None if members is None else frozenset(members)
                del self._waiting[i]
                break
        got = Arrived(tuple(grads), ran)
        if self._sum is not None:
            got = Arrived(tuple(add_grads(a, b) for a, b in zip(self._sum.grads, got.grads)),
                          _union(self._sum.ran, got.ran))
            self._sum = None
        if any(torch._C._will_engine_execute_node(n) for n, _ in self._waiting):
            self._sum = got
            return None
        return got

    def will_run(self) -> bool:
        """Whether a waiting use's backward runs in the backward under way."""
        return any(torch._C._will_engine_execute_node(n) for n, _ in self._waiting)

    def clear(self) -> None:
        """A new step, or a backward that failed: nothing of the last one is waited for."""
        self._waiting.clear()
        self._sum = None


def add_grads(earlier: torch.Tensor | None, grad: torch.Tensor | None) -> torch.Tensor | None:
    """Two uses' gradients of a parameter summed in its dtype, as autograd sums them (None: no
    gradient)."""
    if earlier is None:
        return grad
    return earlier if grad is None else earlier + grad


def _union(a: frozenset | None, b: frozenset | None) -> frozenset | None:
    return None if a is None or b is None else a | b
