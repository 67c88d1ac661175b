"""What happens to a unit between steps and outside the timeline (unit.py has the timeline):
joining its root's schedule, the start of a step and the end of a backward, the reset after a
failure, registered forward methods and summon_full_params. Every state change goes through
`move` (unit_state.py)."""
from __future__ import annotations

from . import checks as unit_checks
from ..wire.comm_policy import policy_in_effect
from ..core.registry import unit_name
from .states import TrainingState, move


class UnitLifecycle:
    """Mixed into runtime.unit.Unit, whose fields and timeline methods these use."""

    # ---- what the schedule asks of its units ------------------------------------------------------
    def join(self, schedule, member_names: list[str], is_root: bool) -> None:
        """Become one of `schedule`'s units, named as the root's module tree names it."""
        self.schedule, self.is_root = schedule, is_root
        self.member_names = member_names
        self.name = unit_name(member_names)
        self.params.rename(self.name)
        policy = policy_in_effect(self.config.comm_policy, schedule.root.config.comm_policy,
                                  self.mp, f"fully_shard({self.type_name}) '{self.name or '<root>'}'")
        for bucket in self.buckets:  # (subclass buckets keep gathering what their hooks give)
            bucket.use_comm_policy(policy)

    def start_step(self) -> None:
        """At the root's pre-forward: users edit models between steps, so the parameters are
        checked before any collective; what the last step left behind goes."""
        if self.training_state is TrainingState.FORWARD:  # the last forward raised
            self.abandon_step()
            self.reshard()  # its gathered values may be stale by now
        unit_checks.check_params_unchanged(self)
        self.params.drop_chunks()  # kept by a forward whose backward never ran
        self.params.uses.clear()
        for bucket in self.buckets:
            bucket.release_grad_shard_if_unused()

    def end_backward(self) -> None:
        """At the end of backward, after the unit's reshard (if it reshards after backward)."""
        # A recomputation (activation checkpointing) may stop early, before its post-forward
        # could put the parameters back.
        self.params.install_sharded()
        self._back_to_idle("the end of backward")
        # Chunks kept for a backward that did not use them (the unit took no part in it) would be
        # gathered, stale, by the next forward: they belong to this step only.
        self.params.drop_chunks()

    # ---- registered forward methods and summon_full_params --------------------------------------
    def enter_method(self) -> None:
        self.method_depth += 1

    def leave_method(self) -> None:
        self.method_depth -= 1

    def method_failed(self) -> None:
        """A registered method raised: its forward is over (a summoned unit stays summoned)."""
        self.method_depth -= 1
        if self.schedule is not None and self.is_root:
            self.schedule.forward_failed()
        if self.training_state is TrainingState.FORWARD:
            move(self, "training_state", TrainingState.IDLE, (TrainingState.FORWARD,),
                 "a registered method's failure")
        self.reshard()

    def enter_summon(self) -> None:
        move(self, "training_state", TrainingState.SUMMONED, (TrainingState.IDLE,),
             "summon_full_params")

    def leave_summon(self) -> None:
        if self.training_state is TrainingState.SUMMONED:
            move(self, "training_state", TrainingState.IDLE, (TrainingState.SUMMONED,),
                 "the end of summon_full_params")

    def abandon_step(self) -> None:
        """reset_iter_state: a forward or a registered method that raised is no longer running."""
        self.wait_unshard()
        self.method_depth = 0
        self._back_to_idle("reset after a failure")

    def _back_to_idle(self, what: str) -> None:
        """Any state but SUMMONED (which its block ends) -> IDLE."""
        if self.training_state is not TrainingState.SUMMONED:
            move(self, "training_state", TrainingState.IDLE, tuple(TrainingState), what)
