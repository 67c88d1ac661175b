"""Diagnostics that look at a sharded model from outside: what it holds, what it did, what is wrong.

Owns: `describe(model)` (describe.py), `memory_report` (memory.py), the timeline drawn from
recorded events or profiler traces (timeline.py), the checks of `fully_shard`'s mesh and group
arguments (input_checks.py) and of an optimizer against a sharded model (optim_check.py).
What runs inside each collective (tags, finite-gradient flags, timeouts) belongs to the
runtime, which this layer reads and never the reverse.

May import: runtime, ops.

Start from `describe` in describe.py.
"""
