"""A unit of several modules (torch's `fully_shard([m1, m2])`): one all-gather and one
reduce-scatter for all of them. The unit's pre-forward runs at the first member to run in a
forward, its post-forward once all of them ran (or at the end of the root's forward, for members
that did not run, as torch does)."""
from __future__ import annotations

import torch

from .mixed_precision import cast_floating
from .unit import Unit
from .unit_state import TrainingState, move


class ListUnit(Unit):
    def __init__(self, *args, **kwargs):
        self.members_to_run: set[int] = set()  # members yet to run in this forward
        super().__init__(*args, **kwargs)

    def _forward_hooks(self):
        return self._member_pre_forward, self._member_post_forward

    def _member_pre_forward(self, module, args, kwargs):
        """The first member to run does the unit's pre-forward; the others, whose parameters are
        then gathered, only cast their inputs. (Recomputation in backward runs per member: the
        pre-forward is idempotent there.)"""
        schedule = self.schedule
        recomputing = schedule is not None and not schedule.standalone and schedule.in_backward()
        if self.members_to_run and not recomputing:
            return cast_floating((args, kwargs), self._input_dtype())
        if not recomputing:
            self.members_to_run = {id(m) for m in self.members}
        return self._pre_forward(module, args, kwargs)

    def _member_post_forward(self, module, args, kwargs, output):
        """The post-forward once every member ran; before that, each output gets the output
        dtype and the pre-backward hook (backward may reach it first)."""
        if id(module) not in self.members_to_run:  # recomputation, or a member called again
            if self.schedule.in_backward():
                return self._post_forward(module, args, kwargs, output)
            return cast_floating(output, self.mp.output_dtype)
        self.members_to_run.discard(id(module))
        if self.members_to_run:
            output = cast_floating(output, self.mp.output_dtype)
            if torch.is_grad_enabled() and self.training_state is not TrainingState.SUMMONED:
                self._register_pre_backward(output)
            return output
        return self._post_forward(module, args, kwargs, output)

    def finish_forward(self) -> None:
        """The root's forward ended with some members not run: their post-forward is done here,
        leaving the parameters sharded."""
        if not self.members_to_run:
            return
        self.members_to_run.clear()
        if self.training_state is not TrainingState.FORWARD:
            return
        move(self, "training_state", TrainingState.IDLE, (TrainingState.FORWARD,),
             "the root's post-forward")
        self.params.install_sharded()
        if not torch.is_grad_enabled() or self.reshards_after_forward:
            self.reshard()

    def start_step(self) -> None:
        self.members_to_run.clear()  # some members did not run in the last forward
        super().start_step()
