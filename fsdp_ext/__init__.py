"""fsdp_ext: a fully-sharded data-parallel runtime for PyTorch."""
# torch's own state-dict type and configs, accepted as they are by state_dict_type()
from torch.distributed.fsdp import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from . import ops  # noqa: F401
from .api import BackwardPrefetch, FSDPModule, ShardingStrategy, fully_shard
from .clip import NonFiniteGradientError, clip_grad_norm_
from .debug import CollectiveError, CollectiveMismatchError
from .describe import describe
from .fsdp1 import FullyShardedDataParallel
from .mixed_precision import MixedPrecision, MixedPrecisionPolicy
from .offload import CPUOffloadPolicy
from .optim_check import check_optimizer
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .load_state_dict import load_full_state_dict
from .load_optim_state_dict import load_optim_state_dict
from .memory import memory_report
from .optim_state_dict import optim_state_dict
from .plan import plan
from .safetensors_io import export_safetensors
from .shutdown import exit_without_finalization, run_then_exit
from .state_dict import full_state_dict, sharded_state_dict
from .storage_cache import empty_cache
from .summon import summon_full_params
from .wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

__all__ = [
    "CheckpointError", "FullStateDictConfig", "ShardedStateDictConfig", "StateDictType",
    "export_safetensors", "load_checkpoint", "load_full_state_dict", "load_optim_state_dict",
    "optim_state_dict", "save_checkpoint", "sharded_state_dict",
    "BackwardPrefetch", "CPUOffloadPolicy", "CollectiveError", "CollectiveMismatchError",
    "FSDPModule", "FullyShardedDataParallel", "MixedPrecision", "MixedPrecisionPolicy",
    "ModuleWrapPolicy", "NonFiniteGradientError", "ShardingStrategy", "clip_grad_norm_",
    "check_optimizer",
    "full_state_dict", "fully_shard", "size_based_auto_wrap_policy", "summon_full_params",
    "describe", "empty_cache", "exit_without_finalization", "memory_report", "plan",
    "run_then_exit",
]
