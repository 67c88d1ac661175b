"""Units: a module (or a list of them) whose parameters are gathered and freed together.

Owns: units and their hooks (unit.py; between steps and outside them: lifecycle.py; a list of
modules as one unit: list_unit.py; their named states and the one function that moves them:
states.py; what torch's setters change: settings.py; what a unit checks for its user: checks.py),
a unit's parameters as a whole and what the modules hold (params.py; the forward uses whose
backward is still to come: backward_uses.py), methods registered to run forward
(forward_methods.py), what a unit is built with (config.py, the environment read once:
fsdp_ext/env.py; the options a root's schedule reads: schedule_options.py), and the execution
order and prefetch (schedule.py).

May import: every other part of the runtime, ops.
"""
