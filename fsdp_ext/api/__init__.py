"""The public entry points, with PyTorch's names and meaning.

Owns: `fully_shard` (fully_shard.py) and `FSDPModule` with torch's methods,
`register_fsdp_forward_method`, `share_comm_ctx` (fsdp_module.py); `FullyShardedDataParallel`
(FSDP1 style, fsdp1.py) with its state-dict settings and optimizer state-dict functions
(fsdp1_state.py); the readers of torch's own option objects (options.py); auto-wrap (wrap.py);
`clip_grad_norm_` over sharded gradients (clip.py); what happens with no process group
(default_group.py); `dp_mesh_dims`, the data-parallel axes of an SPMD mesh (dp_mesh_dims.py);
what torch's pipelining asks of an FSDP stage module (pipelining.py); `replicate`, torch's
FSDP2-based DDP, and its `ReplicateModule` (replicate.py). The table of torch's FSDP
names and what fsdp_ext does with each is tools/compat.py's (docs/compat.md).

May import: state, planner, diagnostics, runtime, ops. Nothing imports it but `fsdp_ext/__init__.py`.

Start from `fully_shard` in fully_shard.py: it builds a `runtime.unit.Unit` for the module and
installs the state-dict hooks; `FullyShardedDataParallel` is a wrapper that calls it per unit.
"""
