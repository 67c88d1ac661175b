"""Diagnostics that look at a sharded model from outside: what it holds, what it did, what is wrong.

Owns: `describe(model)` (describe.py), `memory_report` (memory.py), the timeline drawn from
recorded events or profiler traces (timeline.py), the checks of `fully_shard`'s mesh and group
arguments (input_checks.py) and of an optimizer against a sharded model (optim_check.py), the
stream-order model of the GPU path (stream_check.py) and its count of host syncs by call site
(host_syncs.py), one step's launches recorded under it
(launch_trace.py) and replayed on a modelled GPU, a PROJECTION (gpu_projection.py: the
accelerator's figures and ring formulas are handed in from the planner, a peer layer).
What runs inside each collective (tags, finite-gradient flags, timeouts) belongs to the
runtime, which this layer reads and never the reverse.

May import: runtime, ops.

Start from `describe` in describe.py.
"""
