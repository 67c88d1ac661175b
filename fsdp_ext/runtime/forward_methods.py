"""Methods registered with register_fsdp_forward_method (e.g. `generate`, which calls the encoder
and forward itself): the unit's pre-forward, the method, whose own calls of forward keep the
parameters gathered (the unit's `method_depth` says so), then the post-forward."""
from __future__ import annotations

from .unit_state import TrainingState


def run_method(unit, method, args, kwargs):
    args, kwargs = unit._pre_forward(unit.module, args, kwargs)
    unit.method_depth += 1
    try:
        output = method(*args, **kwargs)
    except BaseException:
        unit.method_depth -= 1
        if unit.schedule is not None and unit.is_root:
            unit.schedule.forward_failed()
        if unit.training_state is TrainingState.FORWARD:  # (summoned: stays so)
            unit.training_state = TrainingState.IDLE
        unit.reshard()
        raise
    unit.method_depth -= 1
    result = unit._post_forward(unit.module, args, kwargs, output)
    return output if result is None else result
