"""The planner: per-rank peak memory and step time of each fsdp_ext setting, before a launch.

Owns: `plan()` (plan.py), the memory / time model (model.py), what it measures on this machine
(measure.py) and the alpha-beta cost of collectives (comm_model.py).

May import: runtime, ops.

Start from `plan` in plan.py; model.py says what each number means.
"""
