"""The unit's state transitions (runtime/unit/states.py): a move from a state not allowed raises,
naming the unit, its module type, the state found, the allowed ones and the target; an allowed one
sets the new state."""
from __future__ import annotations

import types

import pytest

from fsdp_ext.runtime.unit.states import ShardedState, StateError, TrainingState, move


def test_allowed_move_sets_the_state():
    unit = types.SimpleNamespace(name="blocks.0", type_name="Block",
                                 training_state=TrainingState.IDLE)
    move(unit, "training_state", TrainingState.FORWARD, (TrainingState.IDLE,), "pre-forward")
    assert unit.training_state is TrainingState.FORWARD


def test_move_from_another_state_names_unit_and_states():
    unit = types.SimpleNamespace(name="blocks.0", type_name="Block",
                                 training_state=TrainingState.FORWARD)
    with pytest.raises(StateError, match=r"unit 'blocks\.0' \(Block\): pre-forward found "
                       r"TrainingState\.FORWARD, expected one of IDLE \(on the way to FORWARD\)"):
        move(unit, "training_state", TrainingState.FORWARD, (TrainingState.IDLE,), "pre-forward")
    assert unit.training_state is TrainingState.FORWARD  # unchanged


def test_parameter_owner_moves_are_checked_too():
    params = types.SimpleNamespace(name="", sharded_state=ShardedState.SHARDED)
    with pytest.raises(StateError, match=r"unit '<root>': reshard found ShardedState\.SHARDED, "
                       r"expected one of UNSHARDED"):
        move(params, "sharded_state", ShardedState.SHARDED, (ShardedState.UNSHARDED,), "reshard")


def test_which_states_each_hook_may_start_from():
    """One table for every unit (states.pre_forward_from, backward_from), a list unit's open
    pass included, instead of overrides widening a base class's tuples."""
    from fsdp_ext.runtime.unit.states import backward_from, pre_forward_from
    idle, fwd, pre, post = (TrainingState.IDLE, TrainingState.FORWARD,
                            TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
    assert pre_forward_from(in_method=False, pass_open=False) == (idle,)
    assert pre_forward_from(in_method=True, pass_open=False) == (idle, fwd)
    assert pre_forward_from(in_method=False, pass_open=True) == (idle, fwd, post)
    assert backward_from(pass_open=False) == (idle, pre, post)
    assert backward_from(pass_open=True) == (idle, pre, post, fwd)
