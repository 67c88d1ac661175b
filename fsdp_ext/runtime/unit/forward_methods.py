"""Methods registered with register_fsdp_forward_method (e.g. `generate`, which calls the encoder
and forward itself): the unit's pre-forward, the method, whose own calls of forward keep the
parameters gathered (the unit's `method_depth` says so), then the post-forward."""
from __future__ import annotations


def run_method(unit, method, args, kwargs):
    args, kwargs = unit._pre_forward(unit.module, args, kwargs)
    unit.enter_method()
    try:
        output = method(*args, **kwargs)
    except BaseException:
        unit.method_failed()
        raise
    unit.leave_method()
    result = unit._post_forward(unit.module, args, kwargs, output)
    return output if result is None else result
