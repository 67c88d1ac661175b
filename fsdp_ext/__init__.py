"""fsdp_ext: a fully-sharded data-parallel runtime for PyTorch."""
from . import ops  # noqa: F401
from .api import BackwardPrefetch, FSDPModule, ShardingStrategy, fully_shard
from .clip import NonFiniteGradientError, clip_grad_norm_
from .debug import CollectiveError, CollectiveMismatchError
from .fsdp1 import FullyShardedDataParallel
from .mixed_precision import MixedPrecision, MixedPrecisionPolicy
from .offload import CPUOffloadPolicy
from .state_dict import full_state_dict
from .wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

__all__ = [
    "BackwardPrefetch", "CPUOffloadPolicy", "CollectiveError", "CollectiveMismatchError",
    "FSDPModule", "FullyShardedDataParallel", "MixedPrecision", "MixedPrecisionPolicy",
    "ModuleWrapPolicy", "NonFiniteGradientError", "ShardingStrategy", "clip_grad_norm_",
    "full_state_dict", "fully_shard", "size_based_auto_wrap_policy",
]
