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
