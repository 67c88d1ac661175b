"""The hooks that make `module.state_dict()` / `load_state_dict()` of a sharded module speak shards:
the save side lives in state_dict.py, the load side in load_state_dict.py."""
from __future__ import annotations

from torch import nn

from .load_state_dict import load_pre_hook
from .state_dict import post_hook


def install_state_dict_hooks(module: nn.Module) -> None:
    """Called by fully_shard on each unit's module."""
    module.register_state_dict_post_hook(post_hook)
    module.register_load_state_dict_pre_hook(load_pre_hook)
