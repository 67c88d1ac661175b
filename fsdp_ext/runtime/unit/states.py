"""A unit's named states and the one function that moves between them.

    ShardedState   where the unit's parameters are (its buffers: unit_params.py)
        SHARDED --unshard--> UNSHARDING --wait--> UNSHARDED --reshard--> SHARDED
                                                            \\--reshard in forward, k > 1-->
        SHARDED_POST_FORWARD (a 1/k chunk kept for a cheaper regather) --unshard--> UNSHARDING,
                                                            or --drop the chunks--> SHARDED
    TrainingState  which hook of the step the unit is in (unit.py), every move the code allows:
        IDLE --pre-forward--> FORWARD --post-forward--> IDLE --pre-backward--> PRE_BACKWARD
        --post-backward--> POST_BACKWARD --end of backward--> IDLE, the usual step; besides:
        pre-forward        FORWARD -> FORWARD inside a registered method (generate() calling
                           forward); IDLE -> FORWARD otherwise
        post-forward       FORWARD -> IDLE (a list unit: at the root's post-forward too, for
                           members that did not run)
        pre-/post-backward from IDLE (an output that needed no gradient, used by a later
                           unit's backward), PRE_BACKWARD, POST_BACKWARD (a unit used twice
                           runs backward twice) and, in a list unit's open pass, FORWARD (a
                           member run outside the root's forward, backward before the pass ends)
        a failure          FORWARD -> IDLE (a registered method raised); any but SUMMONED ->
                           IDLE (the end of backward, a reset after a failure)
        summon             IDLE -> SUMMONED -> IDLE (summon_full_params)
    Installed      what the modules' parameter attributes hold (params.py writes them)
        SHARDED: the sharded parameters; UNSHARDED: views of the gathered buffers;
        FULL: summon_full_params' full copies
    PassState      a list unit's forward pass over its members (list_unit.py)
        CLOSED --a member's pre-forward--> OPEN --the last member's post-forward, the root's
        post-forward, the end of backward, the next step--> CLOSED

Which TrainingState a hook may start from is written once, below (`pre_forward_from`,
`backward_from`), for a unit in or out of a registered method and in or out of an open pass.

Every transition names the states it may start from: a move from any other raises, naming the
unit and both states, instead of leaving a state that a later hook misreads.
"""
from __future__ import annotations

from enum import Enum, auto


class ShardedState(Enum):
    SHARDED = auto()
    UNSHARDING = auto()             # all-gather in flight
    UNSHARDED = auto()
    SHARDED_POST_FORWARD = auto()   # reshard_after_forward=k: a 1/k chunk kept for backward


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()
    SUMMONED = auto()               # inside summon_full_params


class Installed(Enum):
    SHARDED = auto()
    UNSHARDED = auto()
    FULL = auto()


class PassState(Enum):
    CLOSED = auto()                 # no member of a list unit is yet to run
    OPEN = auto()                   # some members ran, others are yet to


BACKWARD_STATES = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)


def pre_forward_from(in_method: bool, pass_open: bool) -> tuple[TrainingState, ...]:
    """The states a pre-forward may find: IDLE; FORWARD inside a registered method (its own
    forward) or in an open pass (resharded by `reshard()`); POST_BACKWARD in an open pass (a
    chunk's backward ran)."""
    return (TrainingState.IDLE, *((TrainingState.FORWARD,) if in_method or pass_open else ()),
            *((TrainingState.POST_BACKWARD,) if pass_open else ()))


def backward_from(pass_open: bool) -> tuple[TrainingState, ...]:
    """The states a backward hook may find: IDLE (a unit whose forward output needed no
    gradient, used by a later one's backward), PRE_/POST_BACKWARD (a unit used twice in forward
    is freed after its later use's backward and needed again for the earlier one's), and in an
    open pass FORWARD (a member run outside the root's forward, whose backward comes before the
    pass closes)."""
    return (TrainingState.IDLE, *BACKWARD_STATES, *((TrainingState.FORWARD,) if pass_open else ()))


GATHERED = (ShardedState.UNSHARDING, ShardedState.UNSHARDED)  # buffers hold (or get) memory


class StateError(AssertionError):
    """A hook found its unit in a state it cannot start from: a bug in the runtime, or a use
    the runtime does not support (the message names both)."""


def move(owner, attr: str, new: Enum, allowed: tuple[Enum, ...], what: str) -> None:
    """Set `owner.<attr>` to `new` if its current value is one of `allowed`, else raise."""
    current = getattr(owner, attr)
    if current not in allowed:
        kind = f" ({owner.type_name})" if hasattr(owner, "type_name") else ""
        raise StateError(
            f"unit '{owner.name or '<root>'}'{kind}: {what} found {type(current).__name__}."
            f"{current.name}, expected one of {', '.join(s.name for s in allowed)} "
            f"(on the way to {new.name})")
    setattr(owner, attr, new)
