"""Model and optimizer state: state dicts (sharded and full), loading, DCP checkpoints, safetensors.

Owns: `model.state_dict()` / `load_state_dict()` of sharded modules (state_dict.py,
load_state_dict.py, hooks.py), name-keyed optimizer state dicts (optim_state_dict.py,
load_optim_state_dict.py), the ShardedTensor description of a shard (sharded_tensor.py),
atomic DCP checkpoints (checkpoint.py, checkpoint_files.py, checkpoint_template.py), safetensors
export (safetensors_io.py), pretrained weights into the shards (pretrained.py, load_checks.py),
`summon_full_params` (summon.py), names without wrapper components (names.py), and the
all-ranks-fail-together helpers used around file-system work (agree.py).

May import: runtime, ops.

Start from `save_checkpoint` / `load_checkpoint` in checkpoint.py, or `post_hook` in state_dict.py.
"""
