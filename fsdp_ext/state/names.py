"""Parameter names as the unwrapped model has them.

Wrappers applied around submodules (torch's `checkpoint_wrapper`, an FSDP1-style wrapper) add a path
component to `named_parameters()` / `named_modules()` that state-dict keys and checkpoints leave
out; every name the state layer compares with a key goes through `unwrapped_name`.
"""
from __future__ import annotations

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def unwrapped_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
