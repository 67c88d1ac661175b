"""The public entry points, with PyTorch's names and meaning.

Owns: `fully_shard` and `FSDPModule` (FSDP2 style, fully_shard.py), `FullyShardedDataParallel`
(FSDP1 style, fsdp1.py) and its option types (fsdp1_config.py), the auto-wrap policies (wrap.py),
and `clip_grad_norm_` over sharded gradients (clip.py).

May import: state, planner, diagnostics, runtime, ops. Nothing imports it but `fsdp_ext/__init__.py`.

Start from `fully_shard` in fully_shard.py: it builds a `runtime.unit.Unit` for the module and
installs the state-dict hooks; `FullyShardedDataParallel` is a wrapper that calls it per unit.
"""
