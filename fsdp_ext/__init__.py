"""fsdp_ext: a fully-sharded data-parallel runtime for PyTorch (the public API, nothing else).

Layers, each a subpackage that imports only those below it (tests/project/test_layering.py holds the table):

    integrations switches for accelerate / transformers' Trainer and Lightning (import explicitly)
    api          fully_shard, FullyShardedDataParallel, wrap policies, FSDP1 option types
    state        model / optimizer state dicts, DCP checkpoints, safetensors
    planner      memory / time estimates before a launch
    diagnostics  describe, memory report, timeline, input and optimizer checks
    optim        optimizers that need whole matrices of sharded parameters (Muon)
    runtime      units, buckets, schedule and prefetch, collectives, gradient path
    ops          the kernels' entry points (C++ / CUDA / Triton / torch reference)

and below them all, importing nothing of fsdp_ext: env.py (every environment variable fsdp_ext
reads, read there only) and shutdown.py (process exit helpers).
"""
# torch's own option types, enums and policies, exported as they are: a script passes the same
# objects whichever package it imports them from (fsdp_ext/api/options.py reads them)
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, CPUOffloadPolicy,
                                    FullOptimStateDictConfig, FullStateDictConfig,
                                    LocalOptimStateDictConfig, LocalStateDictConfig, MixedPrecision,
                                    MixedPrecisionPolicy, OffloadPolicy, OptimStateKeyType,
                                    ShardedOptimStateDictConfig, ShardedStateDictConfig,
                                    ShardingStrategy, StateDictSettings, StateDictType)
from torch.distributed.fsdp import DataParallelMeshDims
from torch.distributed.fsdp.wrap import (CustomPolicy, ModuleWrapPolicy, always_wrap_policy,
                                         enable_wrap, lambda_auto_wrap_policy,
                                         size_based_auto_wrap_policy,
                                         transformer_auto_wrap_policy, wrap)

from .api.clip import clip_grad_norm_
from .api.fsdp1 import FullyShardedDataParallel
from .api.fsdp_module import (FSDPModule, UnshardHandle, register_fsdp_forward_method,
                              share_comm_ctx)
from .api.fully_shard import fully_shard
from .api.replicate import ReplicateModule, replicate
from .diagnostics.describe import describe
from .diagnostics.memory import memory_report
from .diagnostics.optim_check import check_optimizer
from . import optim  # fsdp_ext.optim.Muon
from .planner.plan import plan
from .runtime.wire.comm_policy import CommPolicy
from .runtime.placement.shard_fn import MeshPlacement
from .runtime.core.errors import CollectiveError, CollectiveMismatchError, NonFiniteGradientError
from .runtime.core.storage_cache import empty_cache
from .shutdown import exit_without_finalization, run_then_exit
from .state.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .state.load_optim_state_dict import load_optim_state_dict
from .state.load_state_dict import load_full_state_dict
from .state.optim_state_dict import optim_state_dict
from .state.pretrained import load_pretrained
from .state.safetensors_io import export_safetensors
from .state.state_dict import full_state_dict, sharded_state_dict
from .state.summon import summon_full_params

__all__ = [
    # FSDP2 style
    "fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
    "share_comm_ctx", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
    "DataParallelMeshDims", "replicate", "ReplicateModule",
    # FSDP1 style
    "FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision",
    "CPUOffload", "ModuleWrapPolicy", "CustomPolicy", "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy", "lambda_auto_wrap_policy", "always_wrap_policy",
    "enable_wrap", "wrap",
    "StateDictType", "StateDictSettings", "FullStateDictConfig", "ShardedStateDictConfig",
    "LocalStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig", "OptimStateKeyType",
    # training loop
    "clip_grad_norm_", "summon_full_params",
    # fewer bytes on the wire (fsdp_ext's own)
    "CommPolicy",
    # a parameter's own mesh from shard_placement_fn, without torch's internals (fsdp_ext's own)
    "MeshPlacement",
    # state dicts and checkpoints
    "full_state_dict", "sharded_state_dict", "load_full_state_dict", "optim_state_dict",
    "load_optim_state_dict", "save_checkpoint", "load_checkpoint", "CheckpointError",
    "export_safetensors", "load_pretrained",
    # planning and diagnostics
    "plan", "describe", "memory_report", "check_optimizer", "empty_cache",
    # errors
    "CollectiveError", "CollectiveMismatchError", "NonFiniteGradientError",
    # process exit on gloo
    "exit_without_finalization", "run_then_exit",
]
