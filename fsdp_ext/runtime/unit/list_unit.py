"""A unit of several modules (torch's `fully_shard([m1, m2])`): one all-gather and one
reduce-scatter for all of them.

A *pass* opens at the first member to run (the unit's pre-forward: gather, install) and closes
once every member ran (the unit's post-forward), or at the end of the root's forward for members
that did not run, or at the end of backward. Members may run in different forwards, as torch's
FSDP2 allows: torchtitan's chunked loss lets the root's forward run `norm` but not `lm_head`,
then calls `lm_head` on each sequence chunk outside any root forward with one `backward()` per
chunk. So while a pass is open (some member yet to run):

  * a member that finds the unit gathered and installed only casts its inputs; one that finds it
    sharded again (the pass's backward ran, or `reshard()`) redoes the pre-forward;
  * its outputs take the pre-backward hook only inside the root's forward (backward may reach
    them before the unit's closing member); a member run outside it (a chunk) takes none, as in
    torch, so a chunk's backward runs the unit's post-backward without an end-of-backward of its
    own: what the root and the other units keep gathered for the decoder's backward stays so;
  * backward hooks may find the unit still in FORWARD.
The pass is a named state (states.PassState) moved as the others are; which training states
an open pass also allows is written with the rest (states.pre_forward_from, backward_from).
"""
from __future__ import annotations

import torch

from ..core.mixed_precision import cast_floating
from .unit import Unit
from .states import Installed, PassState, TrainingState, move


class ListUnit(Unit):
    def __init__(self, *args, **kwargs):
        self.pass_state = PassState.CLOSED
        self._to_run: set[int] = set()   # ids of the members yet to run in the open pass
        self._ran: set[int] = set()      # the indices of those that ran in it
        super().__init__(*args, **kwargs)

    def _forward_hooks(self):
        return self._member_pre_forward, self._member_post_forward

    @property
    def pass_open(self) -> bool:
        return self.pass_state is PassState.OPEN

    def _open_pass(self) -> None:
        move(self, "pass_state", PassState.OPEN, (PassState.CLOSED,), "a member's pre-forward")
        self._to_run = {id(m) for m in self.members}
        self._ran = set()  # a new set: the last pass's uses keep theirs (backward_uses.py)

    def _close_pass(self, what: str) -> None:
        """Close an open pass (no-op when none is): every member ran, or the root's forward,
        the backward or the step it belonged to ended."""
        if self.pass_open:
            move(self, "pass_state", PassState.CLOSED, (PassState.OPEN,), what)
            self._to_run.clear()

    def _member_pre_forward(self, module, args, kwargs):
        """The first member of a pass does the unit's pre-forward; a later one only casts its
        inputs while the unit is installed gathered, else redoes the pre-forward. (Recomputation
        in backward runs per member: the pre-forward is idempotent there.)"""
        schedule = self.schedule
        recomputing = schedule is not None and not schedule.standalone and schedule.in_backward()
        if recomputing:
            return self._pre_forward(module, args, kwargs)
        if (self.pass_open and self.training_state is TrainingState.FORWARD
                and self.params.installed is Installed.UNSHARDED):
            self._ran.add(self._index_of(module))
            return cast_floating((args, kwargs), self._input_dtype())
        if not self.pass_open:
            self._open_pass()
        self._ran.add(self._index_of(module))
        return self._pre_forward(module, args, kwargs)

    def members_running(self) -> set[int]:
        return self._ran

    def _index_of(self, member) -> int:
        return next(i for i, m in enumerate(self.members) if m is member)

    def _member_post_forward(self, module, args, kwargs, output):
        """The post-forward once every member ran; before that, each output gets the output
        dtype, and inside the root's forward the pre-backward hook."""
        if id(module) not in self._to_run:  # recomputation, or a member called again
            if self.schedule.in_backward():
                return self._post_forward(module, args, kwargs, output)
            return cast_floating(output, self.mp.output_dtype)
        self._to_run.discard(id(module))
        if self._to_run:
            output = cast_floating(output, self.mp.output_dtype)
            if (torch.is_grad_enabled() and self.schedule.in_forward
                    and self.training_state is not TrainingState.SUMMONED):
                self._register_pre_backward(output)
            return output
        self._close_pass("the last member's post-forward")
        return self._post_forward(module, args, kwargs, output)

    def finish_forward(self) -> None:
        """The root's forward ended with some members not run: their post-forward is done here,
        leaving the parameters sharded."""
        if not self.pass_open:
            return
        self._close_pass("the root's post-forward")
        if self.training_state is not TrainingState.FORWARD:
            return
        move(self, "training_state", TrainingState.IDLE, (TrainingState.FORWARD,),
             "the root's post-forward")
        self.params.install_sharded()
        if not torch.is_grad_enabled() or self.reshards_after_forward:
            self.reshard()

    def end_backward(self) -> None:
        self._close_pass("the end of backward")  # left open by members run outside the forward
        super().end_backward()

    def start_step(self) -> None:
        self._close_pass("the next step")  # some members did not run in the last forward
        super().start_step()
