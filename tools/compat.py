"""The compatibility table: every public name of the installed torch's FSDP APIs, and what fsdp_ext
does with it. `python tools/compat.py` writes docs/compat.md; `python tools/compat.py --check`
(run by tests/api/test_compat.py) exits 1, saying why, when

- torch has a name the table does not list (a newer torch added one: the test turns red, not a
  user's run),
- the table lists a name torch does not have (stale),
- an entry's test does not exist or does not mention the name (so every row points at a check
  that exercises it),
- fsdp_ext's function lacks one of torch's parameters, or
- docs/compat.md differs from what the table renders.

Names are enumerated by introspection: `torch.distributed.fsdp.__all__` and the policies of
`torch.distributed.fsdp.wrap`; `replicate` (torch's FSDP2-based DDP) and its module class; the
parameters of `fully_shard`, `replicate`, `FullyShardedDataParallel.__init__`
and of every public method (parameters without a default are covered by the method's own row);
the public methods of `FSDPModule`, `UnshardHandle` and `FullyShardedDataParallel` (those it adds
to or overrides of `nn.Module`) and the public attributes of a `FullyShardedDataParallel`
instance; the members of torch's enums and the fields of its option dataclasses.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOC = os.path.join(ROOT, "docs", "compat.md")

TESTED, REFUSED, PARTLY = "tested", "refused", "partly"

# Where the checks live (file, function): a row names one of these by its short key.
F1 = "tests/api/test_fsdp1_surface.py"
F2 = "tests/api/test_fsdp2_surface.py"
IO = "tests/api/test_fsdp2_interop.py"
TL = "tests/end_to_end/test_training_loop.py"
BI = "tests/api/test_bad_inputs.py"
DP = "tests/api/test_dp_mesh_dims.py"
PL = "tests/runtime/test_placements.py"
CHECKS = {
    "pl.dims": (PL, "check_dim_1"),
    "dp.hsdp": (DP, "check_hsdp"),
    "dp.flattened": (DP, "check_flattened_shard_axes"),
    "f1.strategies": (F1, "check_sharding_strategies"),
    "f1.prefetch": (F1, "check_backward_prefetch_and_flags"),
    "f1.mp_offload": (F1, "check_mixed_precision_and_offload"),
    "f1.mp_fields": (F1, "check_mixed_precision_fields"),
    "f1.batchnorm": (F1, "check_batchnorm_stays_full_precision"),
    "f1.policies": (F1, "check_wrap_policies"),
    "f1.ignored": (F1, "check_ignored_and_orig_params"),
    "f1.attributes": (F1, "check_attributes"),
    "f1.summon": (F1, "check_summon_and_apply"),
    "f1.state_dicts": (F1, "check_state_dict_types"),
    "f1.optim": (F1, "check_optimizer_state_dicts"),
    "f1.no_sync": (F1, "check_no_sync_and_clip"),
    "f1.hybrid": (F1, "check_hybrid_groups_and_manual_wrap"),
    "f1.refused": (F1, "check_refused_state_dict_options"),
    "f2.isinstance": (F2, "check_is_torch_fsdp_module"),
    "f2.unshard": (F2, "check_unshard_and_reshard"),
    "f2.prefetch": (F2, "check_explicit_prefetch"),
    "f2.accumulation": (F2, "check_accumulation_knobs"),
    "f2.reduction": (F2, "check_reduction_knobs"),
    "f2.replicas": (F2, "check_replicas_defer_all_reduce"),
    "f2.unshard_in_backward": (F2, "check_unshard_in_backward"),
    "f2.reset": (F2, "check_reset_iter_state"),
    "f2.methods": (F2, "check_forward_methods"),
    "f2.ignored": (F2, "check_ignored_params_and_policies"),
    "f2.comm_ctx": (F2, "check_comm_ctx_and_post_optim_event"),
    "f2.refused": (F2, "check_refused"),
    "f2.arguments": (F2, "check_fully_shard_arguments"),
    "f2.never_run": (F2, "check_units_that_never_run"),
    "f2.lists": (F2, "check_list_units"),
    "meta": (TL, "check_meta_init"),
    "sync": (TL, "check_summon_and_sync_module_states"),
    "rp.torch": ("tests/api/test_replicate.py", "check_against_torch"),
    "rp.options": ("tests/api/test_replicate.py", "check_options_against_torch"),
    "rp.dims": ("tests/api/test_replicate.py", "check_dp_mesh_dims_against_torch"),
}

# (status, check key, note). The note says what a user needs to know: the meaning where it is not
# obvious, what is refused and what to do instead, or how it differs from torch.
_PRE = "FullyShardedDataParallel"
ENTRIES: dict[str, tuple[str, str, str]] = {
    # ---- torch.distributed.fsdp.__all__ (fsdp_ext exports torch's own objects) ----
    "fsdp.BackwardPrefetch": (TESTED, "f1.prefetch", "torch's enum, read by member name"),
    "fsdp.CPUOffload": (TESTED, "f1.mp_offload", ""),
    "fsdp.CPUOffloadPolicy": (TESTED, "f2.arguments", ""),
    "fsdp.DataParallelMeshDims": (PARTLY, "dp.hsdp", "see fully_shard(dp_mesh_dims)"),
    "fsdp.FSDPModule": (TESTED, "f2.isinstance",
                        "sharded modules are instances of torch's FSDPModule"),
    "fsdp.FullOptimStateDictConfig": (TESTED, "f1.state_dicts",
                                      "FSDP1's default optimizer config"),
    "fsdp.FullStateDictConfig": (TESTED, "f1.state_dicts", ""),
    "fsdp.FullyShardedDataParallel": (TESTED, "f1.attributes", "FSDP1's wrapper"),
    "fsdp.LocalOptimStateDictConfig": (REFUSED, "f1.refused", "LOCAL_STATE_DICT is refused"),
    "fsdp.LocalStateDictConfig": (REFUSED, "f1.refused", "LOCAL_STATE_DICT is refused"),
    "fsdp.MixedPrecision": (TESTED, "f1.mp_offload", ""),
    "fsdp.MixedPrecisionPolicy": (TESTED, "f2.arguments", ""),
    "fsdp.OffloadPolicy": (TESTED, "f2.ignored", "torch's default: no offload"),
    "fsdp.OptimStateDictConfig": (TESTED, "f1.refused",
                                  "base class; its subclasses are the configs"),
    "fsdp.OptimStateKeyType": (TESTED, "f1.optim", ""),
    "fsdp.ShardedOptimStateDictConfig": (TESTED, "f1.refused", ""),
    "fsdp.ShardedStateDictConfig": (TESTED, "f1.state_dicts", ""),
    "fsdp.ShardingStrategy": (TESTED, "f1.strategies", "torch's enum, read by member name"),
    "fsdp.StateDictConfig": (TESTED, "f1.state_dicts",
                             "base class; its subclasses are the configs"),
    "fsdp.StateDictSettings": (TESTED, "f1.state_dicts", "what get_state_dict_type returns"),
    "fsdp.StateDictType": (TESTED, "f1.state_dicts", ""),
    "fsdp.UnshardHandle": (TESTED, "f2.unshard", "what unshard(async_op=True) returns"),
    "fsdp.fully_shard": (TESTED, "f2.arguments", ""),
    "fsdp.register_fsdp_forward_method": (TESTED, "f2.methods",
                                          "torch's function works on fsdp_ext modules too"),
    "fsdp.share_comm_ctx": (TESTED, "f2.comm_ctx", ""),
    # ---- torch.distributed.fsdp.wrap ----
    "wrap.CustomPolicy": (TESTED, "f1.policies", "per-module overrides honoured"),
    "wrap.ModuleWrapPolicy": (TESTED, "f1.policies", ""),
    "wrap.always_wrap_policy": (TESTED, "f1.policies",
                                "ModuleList/ModuleDict never become units (torch wraps them)"),
    "wrap.enable_wrap": (TESTED, "f1.hybrid", "manual nesting"),
    "wrap.lambda_auto_wrap_policy": (TESTED, "f1.policies", ""),
    "wrap.size_based_auto_wrap_policy": (TESTED, "f1.policies",
                                         "containers whose forward never runs are skipped"),
    "wrap.transformer_auto_wrap_policy": (TESTED, "f1.policies", ""),
    "wrap.wrap": (TESTED, "f1.hybrid", "manual nesting"),
    # ---- fully_shard(...) ----
    "fully_shard(mesh)": (TESTED, "f2.arguments", "1-D (shard) or 2-D (replicate, shard)"),
    "fully_shard(reshard_after_forward)": (TESTED, "f2.arguments",
                                           "bool or int (1 = False, shard size = True)"),
    "fully_shard(shard_placement_fn)": (TESTED, "pl.dims",
                                        "Shard(dim) for any dim (uneven sizes padded; torch "
                                        "refuses them for dim > 0) or None; torch's "
                                        "ShardPlacementResult with an FSDPMeshInfo or "
                                        "HSDPMeshInfo (with CPU offload and "
                                        "reshard_after_forward=k too), a mesh-info over named "
                                        "axes (spmd_types-annotated or storage-mesh DTensor "
                                        "experts), or fsdp_ext's MeshPlacement; expert-parallel "
                                        "DTensors sharded again over their own mesh "
                                        "(`test_expert_parallel.py`, torchtitan's trainer at "
                                        "EP 2); other placements refused naming the parameter"),
    "fully_shard(mp_policy)": (TESTED, "f2.arguments", ""),
    "fully_shard(offload_policy)": (TESTED, "f2.arguments", ""),
    "fully_shard(ignored_params)": (TESTED, "f2.ignored", ""),
    "fully_shard(dp_mesh_dims)": (PARTLY, "dp.hsdp",
                                  "the named axes of the SPMD mesh (one shard axis, several "
                                  "flattened, HSDP, replicate only) with plain parameters, as "
                                  "torchtitan's spmd_types backend passes them, or DTensors "
                                  "on that mesh (its full_dtensor backend: the same layouts, "
                                  "flattened shard axes adjacent in the mesh); a TP axis read "
                                  "from the DTensors' placements or the annotations (S(dim), "
                                  "R, I); a missing annotation, a plain parameter on two such "
                                  "axes, a DTensor on another mesh or on shard axes apart from "
                                  "each other, refused naming the parameter"),
    "fully_shard(module)": (TESTED, "f2.lists",
                            "a module, or a list of modules sharded as one unit"),
    # ---- replicate (torch's FSDP2-based DDP) ----
    "replicate": (TESTED, "rp.torch", "fsdp_ext.replicate: every rank holds the whole module, "
                  "gradients all-reduced (averaged); parameters DTensors Replicate() on the "
                  "1-D mesh"),
    "ReplicateModule": (TESTED, "rp.torch", "fsdp_ext.ReplicateModule subclasses torch's "
                        "(and fsdp_ext's FSDPModule): torch's pipelining stage drives it (test_pipelining.py)"),
    "replicate(module)": (TESTED, "rp.torch", "a module, or a list of modules as one unit"),
    "replicate(mesh)": (TESTED, "rp.torch", "1-D; default: every rank"),
    "replicate(mp_policy)": (TESTED, "rp.options", ""),
    "replicate(offload_policy)": (TESTED, "rp.options", ""),
    "replicate(ignored_params)": (TESTED, "rp.options", ""),
    "replicate(dp_mesh_dims)": (TESTED, "rp.dims", "replicate axes only, as torch's"),
    # ---- FSDPModule methods ----
    "FSDPModule.reshard": (TESTED, "f2.unshard", ""),
    "FSDPModule.unshard": (TESTED, "f2.unshard", ""),
    "FSDPModule.unshard(async_op)": (TESTED, "f2.unshard", ""),
    "FSDPModule.reset_iter_state": (TESTED, "f2.reset", "on the root"),
    "FSDPModule.set_is_last_backward": (TESTED, "f2.accumulation",
                                        "honoured before the first forward too, on the root "
                                        "(test_setter_behaviour.py)"),
    "FSDPModule.set_requires_gradient_sync": (TESTED, "f2.accumulation",
                                              "the collectives it removes are torch's "
                                              "(test_setter_behaviour.py)"),
    "FSDPModule.set_requires_gradient_sync(recurse)": (TESTED, "f2.accumulation", ""),
    "FSDPModule.set_requires_all_reduce": (TESTED, "f2.replicas", ""),
    "FSDPModule.set_requires_all_reduce(recurse)": (TESTED, "f2.replicas", ""),
    "FSDPModule.set_reshard_after_forward": (TESTED, "f2.accumulation",
                                             "the all-gathers it removes are torch's, but for "
                                             "the forward's last unit, which fsdp_ext never "
                                             "regathers (test_setter_behaviour.py)"),
    "FSDPModule.set_reshard_after_forward(recurse)": (TESTED, "f2.accumulation", ""),
    "FSDPModule.set_reshard_after_backward": (TESTED, "f2.accumulation",
                                              "False keeps the unit gathered; its sharded "
                                              "DTensors are the registered parameters again "
                                              "after backward"),
    "FSDPModule.set_reshard_after_backward(recurse)": (TESTED, "f2.accumulation", ""),
    "FSDPModule.set_modules_to_forward_prefetch": (TESTED, "f2.prefetch", ""),
    "FSDPModule.set_modules_to_backward_prefetch": (TESTED, "f2.prefetch", ""),
    "FSDPModule.set_custom_all_gather": (REFUSED, "f2.refused",
                                         "the all-gather writes into fsdp_ext's own buffers"),
    "FSDPModule.set_custom_reduce_scatter": (REFUSED, "f2.refused",
                                             "the gradient path packs with fsdp_ext's kernels"),
    "FSDPModule.set_all_reduce_hook": (TESTED, "f2.reduction", ""),
    "FSDPModule.set_all_reduce_hook(stream)": (PARTLY, "f2.reduction",
                                               "None honoured (the hook runs on the reduce "
                                               "stream, after the reduction); a stream refused"),
    "FSDPModule.set_post_optim_event": (TESTED, "f2.comm_ctx", ""),
    "FSDPModule.set_reduce_scatter_divide_factor": (TESTED, "f2.reduction",
                                                    "deprecated alias, as in torch"),
    "FSDPModule.set_gradient_divide_factor": (TESTED, "f2.reduction", ""),
    "FSDPModule.set_force_sum_reduction_for_comms": (TESTED, "f2.reduction", ""),
    "FSDPModule.set_reduce_scatter_unused_params": (TESTED, "f2.reduction", ""),
    "FSDPModule.set_reduce_scatter_unused_params(recurse)": (TESTED, "f2.reduction", ""),
    "FSDPModule.set_reduce_scatter_max_input_buffers": (TESTED, "f2.reduction", ""),
    "FSDPModule.set_reduce_scatter_max_input_buffers(recurse)": (TESTED, "f2.reduction", ""),
    "FSDPModule.set_separate_reduce_scatter_group": (TESTED, "f2.reduction", ""),
    "FSDPModule.set_separate_reduce_scatter_group(enable)": (TESTED, "f2.reduction", ""),
    "FSDPModule.set_separate_reduce_scatter_group(recurse)": (TESTED, "f2.reduction", ""),
    "FSDPModule.set_unshard_in_backward": (TESTED, "f2.unshard_in_backward", ""),
    "FSDPModule.set_allocate_memory_from_process_group_for_comm": (
        PARTLY, "f2.refused", "False (the default) accepted; True refused"),
    "FSDPModule.set_symm_mem_for_comm": (REFUSED, "f2.refused",
                                         "symmetric memory needs CUDA and NVSHMEM"),
    "FSDPModule.set_symm_mem_for_comm(backend)": (REFUSED, "f2.refused", ""),
    "UnshardHandle.wait": (TESTED, "f2.unshard", ""),
    # ---- FullyShardedDataParallel(...) ----
    f"{_PRE}(process_group)": (TESTED, "f1.hybrid", "a group, or (shard, replicate) groups"),
    f"{_PRE}(sharding_strategy)": (TESTED, "f1.strategies", "every member of torch's enum"),
    f"{_PRE}(cpu_offload)": (TESTED, "f1.mp_offload", ""),
    f"{_PRE}(auto_wrap_policy)": (TESTED, "f1.policies",
                                  "torch's policy objects and callables"),
    f"{_PRE}(backward_prefetch)": (TESTED, "f1.prefetch", ""),
    f"{_PRE}(mixed_precision)": (TESTED, "f1.mp_offload", ""),
    f"{_PRE}(ignored_modules)": (TESTED, "f1.ignored", ""),
    f"{_PRE}(param_init_fn)": (TESTED, "meta", ""),
    f"{_PRE}(device_id)": (TESTED, "f1.attributes", "sets compute_device"),
    f"{_PRE}(sync_module_states)": (TESTED, "sync", ""),
    f"{_PRE}(forward_prefetch)": (TESTED, "f1.prefetch", ""),
    f"{_PRE}(limit_all_gathers)": (TESTED, "f1.prefetch", ""),
    f"{_PRE}(use_orig_params)": (TESTED, "f1.ignored",
                                 "both values: the user's parameters are always kept"),
    f"{_PRE}(ignored_states)": (TESTED, "f1.ignored", ""),
    f"{_PRE}(device_mesh)": (TESTED, "f1.hybrid", "2-D (replicate, shard) for HYBRID_SHARD"),
    # ---- FullyShardedDataParallel methods and attributes ----
    f"{_PRE}.apply": (TESTED, "f1.summon", "runs with the full parameters summoned"),
    f"{_PRE}.check_is_root": (TESTED, "f1.attributes", ""),
    f"{_PRE}.clip_grad_norm_": (TESTED, "f1.no_sync", ""),
    f"{_PRE}.clip_grad_norm_(norm_type)": (TESTED, "f1.no_sync", ""),
    f"{_PRE}.flatten_sharded_optim_state_dict": (TESTED, "f1.optim", ""),
    f"{_PRE}.forward": (TESTED, "f1.attributes", ""),
    f"{_PRE}.fsdp_modules": (TESTED, "f1.attributes", ""),
    f"{_PRE}.fsdp_modules(root_only)": (TESTED, "f1.attributes", ""),
    f"{_PRE}.full_optim_state_dict": (TESTED, "f1.optim", "keyed by parameter name"),
    f"{_PRE}.full_optim_state_dict(optim_input)": (REFUSED, "f1.optim",
                                                   "deprecated in torch: pass optim"),
    f"{_PRE}.full_optim_state_dict(rank0_only)": (TESTED, "f1.optim", ""),
    f"{_PRE}.full_optim_state_dict(group)": (PARTLY, "f1.refused",
                                             "None or the world group; other groups refused"),
    f"{_PRE}.get_state_dict_type": (TESTED, "f1.state_dicts", ""),
    f"{_PRE}.module": (TESTED, "f1.ignored", ""),
    f"{_PRE}.named_buffers": (TESTED, "f1.hybrid",
                              "the unwrapped model's names (torch: only inside summon)"),
    f"{_PRE}.named_parameters": (TESTED, "f1.hybrid",
                                 "the unwrapped model's names (torch: only inside summon)"),
    f"{_PRE}.no_sync": (TESTED, "f1.no_sync", ""),
    f"{_PRE}.optim_state_dict": (TESTED, "f1.optim", ""),
    f"{_PRE}.optim_state_dict(optim_state_dict)": (TESTED, "f1.optim", ""),
    f"{_PRE}.optim_state_dict(group)": (PARTLY, "f1.refused",
                                        "None or the world group; other groups refused"),
    f"{_PRE}.optim_state_dict_to_load": (TESTED, "f1.optim", ""),
    f"{_PRE}.optim_state_dict_to_load(is_named_optimizer)": (
        REFUSED, "f1.refused", "torchrec's named optimizers"),
    f"{_PRE}.optim_state_dict_to_load(load_directly)": (TESTED, "f1.optim", ""),
    f"{_PRE}.optim_state_dict_to_load(group)": (PARTLY, "f1.refused",
                                                "None or the world group; other groups refused"),
    f"{_PRE}.register_comm_hook": (REFUSED, "f1.attributes",
                                   "the gradient path is fsdp_ext's kernels; use FSDPModule."
                                   "set_all_reduce_hook for replicas"),
    f"{_PRE}.rekey_optim_state_dict": (TESTED, "f1.optim", ""),
    f"{_PRE}.rekey_optim_state_dict(optim_input)": (REFUSED, "f1.optim",
                                                    "deprecated in torch: pass optim"),
    f"{_PRE}.rekey_optim_state_dict(optim)": (TESTED, "f1.optim", ""),
    f"{_PRE}.scatter_full_optim_state_dict": (TESTED, "f1.optim", ""),
    f"{_PRE}.scatter_full_optim_state_dict(optim_input)": (REFUSED, "f1.optim",
                                                           "deprecated in torch: pass optim"),
    f"{_PRE}.scatter_full_optim_state_dict(optim)": (TESTED, "f1.optim", ""),
    f"{_PRE}.scatter_full_optim_state_dict(group)": (PARTLY, "f1.refused",
                                                     "None or the world group"),
    f"{_PRE}.set_state_dict_type": (TESTED, "f1.state_dicts", ""),
    f"{_PRE}.set_state_dict_type(state_dict_config)": (TESTED, "f1.state_dicts", ""),
    f"{_PRE}.set_state_dict_type(optim_state_dict_config)": (TESTED, "f1.refused", ""),
    f"{_PRE}.shard_full_optim_state_dict": (TESTED, "f1.optim", ""),
    f"{_PRE}.shard_full_optim_state_dict(optim_input)": (REFUSED, "f1.optim",
                                                         "deprecated in torch: pass optim"),
    f"{_PRE}.shard_full_optim_state_dict(optim)": (TESTED, "f1.optim", ""),
    f"{_PRE}.sharded_optim_state_dict": (TESTED, "f1.optim", ""),
    f"{_PRE}.sharded_optim_state_dict(group)": (PARTLY, "f1.refused", "None or the world group"),
    f"{_PRE}.state_dict_type": (TESTED, "f1.state_dicts", ""),
    f"{_PRE}.state_dict_type(state_dict_config)": (TESTED, "f1.state_dicts", ""),
    f"{_PRE}.state_dict_type(optim_state_dict_config)": (TESTED, "f1.refused", ""),
    f"{_PRE}.summon_full_params": (TESTED, "f1.summon", ""),
    f"{_PRE}.summon_full_params(recurse)": (TESTED, "f1.summon", ""),
    f"{_PRE}.summon_full_params(writeback)": (TESTED, "f1.summon", ""),
    f"{_PRE}.summon_full_params(rank0_only)": (TESTED, "f1.summon", ""),
    f"{_PRE}.summon_full_params(offload_to_cpu)": (TESTED, "f1.summon", ""),
    f"{_PRE}.summon_full_params(with_grads)": (TESTED, "f1.summon", ""),
    f"{_PRE}.backward_prefetch": (TESTED, "f1.attributes", ""),
    f"{_PRE}.compute_device": (TESTED, "f1.attributes", ""),
    f"{_PRE}.cpu_offload": (TESTED, "f1.attributes", ""),
    f"{_PRE}.forward_prefetch": (TESTED, "f1.attributes", ""),
    f"{_PRE}.limit_all_gathers": (TESTED, "f1.attributes", ""),
    f"{_PRE}.mixed_precision": (TESTED, "f1.attributes", ""),
    f"{_PRE}.params": (REFUSED, "f1.attributes",
                       "FSDP1's FlatParameters do not exist: use .parameters()"),
    f"{_PRE}.process_group": (TESTED, "f1.attributes", ""),
    f"{_PRE}.rank": (TESTED, "f1.attributes", ""),
    f"{_PRE}.sharding_strategy": (TESTED, "f1.attributes", ""),
    f"{_PRE}.training_state": (TESTED, "f1.attributes", ""),
    f"{_PRE}.world_size": (TESTED, "f1.attributes", ""),
    # ---- enum members ----
    "ShardingStrategy.FULL_SHARD": (TESTED, "f1.strategies", ""),
    "ShardingStrategy.SHARD_GRAD_OP": (TESTED, "f1.strategies", ""),
    "ShardingStrategy.NO_SHARD": (TESTED, "f1.strategies", "every rank holds everything"),
    "ShardingStrategy.HYBRID_SHARD": (TESTED, "f1.hybrid", ""),
    "ShardingStrategy._HYBRID_SHARD_ZERO2": (TESTED, "f1.hybrid", ""),
    "BackwardPrefetch.BACKWARD_PRE": (TESTED, "f1.prefetch", ""),
    "BackwardPrefetch.BACKWARD_POST": (TESTED, "f1.prefetch", ""),
    "StateDictType.FULL_STATE_DICT": (TESTED, "f1.state_dicts", "FSDP1's default"),
    "StateDictType.SHARDED_STATE_DICT": (TESTED, "f1.state_dicts",
                                         "ShardedTensors over the flattened parameters"),
    "StateDictType.LOCAL_STATE_DICT": (REFUSED, "f1.refused",
                                       "use SHARDED_STATE_DICT (per-rank, loadable at another "
                                       "world size)"),
    "OptimStateKeyType.PARAM_NAME": (TESTED, "f1.optim", ""),
    "OptimStateKeyType.PARAM_ID": (TESTED, "f1.optim", ""),
    # ---- dataclass fields ----
    "MixedPrecision.param_dtype": (TESTED, "f1.mp_offload", ""),
    "MixedPrecision.reduce_dtype": (TESTED, "f1.mp_offload", ""),
    "MixedPrecision.buffer_dtype": (TESTED, "f1.mp_offload", ""),
    "MixedPrecision.keep_low_precision_grads": (PARTLY, "f1.mp_offload",
                                                "False (the default) honoured; True refused"),
    "MixedPrecision.cast_forward_inputs": (TESTED, "f1.mp_fields", ""),
    "MixedPrecision.cast_root_forward_inputs": (TESTED, "f1.mp_fields", ""),
    "MixedPrecision._module_classes_to_ignore": (TESTED, "f1.mp_fields",
                                                 "those modules are full-precision units"),
    "CPUOffload.offload_params": (TESTED, "f1.mp_offload", ""),
    "MixedPrecisionPolicy.param_dtype": (TESTED, "f2.arguments", ""),
    "MixedPrecisionPolicy.reduce_dtype": (TESTED, "f2.arguments", ""),
    "MixedPrecisionPolicy.output_dtype": (TESTED, "f2.arguments", ""),
    "MixedPrecisionPolicy.cast_forward_inputs": (TESTED, "f2.arguments", ""),
    "CPUOffloadPolicy.pin_memory": (TESTED, "f2.arguments", ""),
    "DataParallelMeshDims.shard": (TESTED, "dp.flattened", "one name, or several flattened"),
    "DataParallelMeshDims.replicate": (TESTED, "dp.hsdp", "with shard: HSDP; alone: "
                                       "replicate only"),
    "FullStateDictConfig.offload_to_cpu": (TESTED, "f1.state_dicts", ""),
    "FullStateDictConfig.rank0_only": (TESTED, "f1.state_dicts", ""),
    "ShardedStateDictConfig.offload_to_cpu": (TESTED, "f1.state_dicts", ""),
    "ShardedStateDictConfig._use_dtensor": (PARTLY, "f1.refused", "True refused"),
    "LocalStateDictConfig.offload_to_cpu": (REFUSED, "f1.refused", "LOCAL_STATE_DICT is refused"),
    "FullOptimStateDictConfig.offload_to_cpu": (TESTED, "f1.refused", ""),
    "FullOptimStateDictConfig.rank0_only": (TESTED, "f1.optim", ""),
    "ShardedOptimStateDictConfig.offload_to_cpu": (TESTED, "f1.refused", ""),
    "ShardedOptimStateDictConfig._use_dtensor": (PARTLY, "f1.refused", "True refused"),
    "LocalOptimStateDictConfig.offload_to_cpu": (REFUSED, "f1.refused",
                                                 "LOCAL_STATE_DICT is refused"),
    "StateDictConfig.offload_to_cpu": (TESTED, "f1.state_dicts", ""),
    "OptimStateDictConfig.offload_to_cpu": (TESTED, "f1.refused", ""),
    "StateDictSettings.state_dict_type": (TESTED, "f1.state_dicts", ""),
    "StateDictSettings.state_dict_config": (TESTED, "f1.state_dicts", ""),
    "StateDictSettings.optim_state_dict_config": (TESTED, "f1.refused", ""),
}

# Where fsdp_ext behaves differently from torch on purpose, for the page.
DIFFERENCES = [
    "`FullyShardedDataParallel`'s SHARDED_STATE_DICT entries are ShardedTensors over each "
    "parameter flattened to 1-D (torch's FSDP1 keeps row-wise shards); fsdp_ext loads its own "
    "and full state dicts, and `fully_shard` models use DTensor state dicts as torch's FSDP2.",
    "A parameter tied across two units (shared by modules sharded separately) is refused at "
    "wrap time, naming both; torch's FSDP1 silently gives it to one unit.",
    "A list of modules given to `fully_shard` cannot be the root (the first unit to run "
    "forward): it is refused at that forward, naming the modules; shard the model that contains "
    "them too, as torch's bottom-up order does.",
    "`set_reshard_after_backward(False)` keeps the gathered buffers, but after backward the "
    "registered parameters are the sharded DTensors again (torch leaves the unsharded "
    "tensors registered); the next forward reuses the gathered data without an all-gather.",
    "Auto-wrap never makes a `ModuleList`/`ModuleDict` a unit (their `forward` never runs); "
    "torch's `always_wrap_policy` wraps them as empty FSDP instances.",
    "`FullyShardedDataParallel.named_parameters()`/`named_buffers()` give the unwrapped model's "
    "names always; torch's FSDP1 strips `_fsdp_wrapped_module.` only inside "
    "`summon_full_params`.",
    "A rank that reaches the model's first forward late (loading a checkpoint alone) is waited "
    "for as torch's first collective waits, up to the process group's timeout, unless "
    "`collective_timeout` is set (then up to it). Past that the others each raise a "
    "CollectiveError naming it and how long they waited, and the late rank, when it arrives, "
    "one saying they gave up waiting for it; torch's ranks each fail with the backend's timeout "
    "error, naming no rank (`test_reliability.py::"
    "test_rank_later_than_the_process_group_timeout_hears_the_others_gave_up`). The root's "
    "`collective_timeout` also bounds the creation of its blocks' `reshard_after_forward=k` "
    "groups, made at its first forward.",
    "A cast after sharding (`model.to(torch.bfloat16)`, `.half()`, `.double()`) is refused "
    "before anything changes, naming the parameter and the alternatives (MixedPrecisionPolicy's "
    "`param_dtype` to compute in another dtype, a cast before `fully_shard` to store one, the "
    "full state dict to export one); torch's FSDP2 casts the shards "
    "(`test_bad_inputs.py::check_parameter_dtypes`).",
    "The gathered parameters a module holds inside forward and after `unshard()` are "
    "`nn.Parameter`s (`isinstance`, `get_parameter`) viewing the gathered buffer, but not autograd "
    "leaves: their `.grad` stays None (the gradient goes to the sharded parameter, as under "
    "torch); torch's are leaf Parameters.",
    "A parameter whose module did not run (a member of a list unit left out of a forward, as "
    "torchtitan's chunked loss leaves `lm_head`) is not sent, as torch sends only parameters with "
    "a gradient; a parameter whose module ran but got no gradient on this rank is sent as zeros "
    "(another rank may have used it), where torch would need every rank to agree.",
    "Found while testing against torch 2.14.1 on CPU/gloo: its FSDP1 `optim_state_dict` files "
    "optimizer states under other parameters' names for the test GPT (so resumed runs "
    "diverge), and its HYBRID_SHARD with a shard group of size 1 drifts from the single-"
    "process losses; fsdp_ext's tests compare with the unwrapped model there.",
]


# ---- introspection -----------------------------------------------------------------------------
def _params_with_defaults(fn) -> list[str]:
    fn = inspect.unwrap(fn)
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.default is not inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _methods(cls, skip: set[str]) -> dict[str, object]:
    out = {}
    for name, value in vars(cls).items():
        if name.startswith("_") or name in skip:
            continue
        fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if callable(fn):
            out[name] = fn
    return out


def _fsdp1_instance_attributes() -> list[str]:
    """Public attributes a torch FullyShardedDataParallel instance sets (world-1 gloo group)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel
    own = not dist.is_initialized()
    if own:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = FullyShardedDataParallel(nn.Linear(2, 2), device_id=torch.device("cpu"))
        plain = set(vars(nn.Linear(2, 2)))
        return sorted(k for k in vars(wrapped) if not k.startswith("_") and k not in plain)
    finally:
        if own:
            dist.destroy_process_group()


def torch_names() -> list[str]:
    import torch.distributed.fsdp as tf
    import torch.distributed.fsdp.wrap as tw
    from torch import nn
    names = [f"fsdp.{n}" for n in tf.__all__]
    names += [f"wrap.{n}" for n, v in vars(tw).items()
              if not n.startswith("_") and getattr(v, "__module__", None) == tw.__name__]
    names += [f"fully_shard({p})" for p in inspect.signature(tf.fully_shard).parameters]
    from torch.distributed._composable import replicate_with_fsdp as rw
    names += ["replicate", "ReplicateModule"]
    names += [f"replicate({p})" for p in inspect.signature(rw.replicate).parameters]
    for cls, skip in ((tf.FSDPModule, set()), (tf.UnshardHandle, set())):
        for name, fn in _methods(cls, skip).items():
            names.append(f"{cls.__name__}.{name}")
            names += [f"{cls.__name__}.{name}({p})" for p in _params_with_defaults(fn)]
    fsdp1 = tf.FullyShardedDataParallel
    names += [f"{_PRE}({p})" for p in inspect.signature(fsdp1.__init__).parameters
              if p not in ("self", "module")]
    module_api = {n for n in dir(nn.Module)} - set(vars(fsdp1))
    for name, fn in _methods(fsdp1, module_api).items():
        names.append(f"{_PRE}.{name}")
        names += [f"{_PRE}.{name}({p})" for p in _params_with_defaults(fn)]
    names += [f"{_PRE}.{n}" for n, v in vars(fsdp1).items()
              if isinstance(v, property) and not n.startswith("_")]
    names += [f"{_PRE}.{n}" for n in _fsdp1_instance_attributes()]
    for obj in vars(tf).values():
        if isinstance(obj, type) and issubclass(obj, enum.Enum) and obj.__name__ in tf.__all__:
            names += [f"{obj.__name__}.{m}" for m in obj.__members__]
        elif dataclasses.is_dataclass(obj) and obj.__name__ in tf.__all__:
            names += [f"{obj.__name__}.{f.name}" for f in dataclasses.fields(obj)]
    return list(dict.fromkeys(names))


# ---- checks ------------------------------------------------------------------------------------
def _probe(key: str) -> str:
    """The word the referenced check must contain: the parameter, member, field or name."""
    if key.endswith(")"):
        return key[key.rindex("(") + 1:-1]
    return key.rsplit(".", 1)[-1]


def _function_source(path: str, function: str) -> str | None:
    with open(os.path.join(ROOT, path)) as f:
        source = f.read()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return ast.get_source_segment(source, node)
    return None


def _ours(key: str):
    """fsdp_ext's function for a torch function's row, or None if the row is not a function."""
    import fsdp_ext
    if key.startswith("fully_shard("):
        return fsdp_ext.fully_shard
    if key.startswith("replicate("):
        return fsdp_ext.replicate
    if key.startswith(f"{_PRE}("):
        return fsdp_ext.FullyShardedDataParallel.__init__
    head = key.split("(")[0]
    if "(" not in key or "." not in head:
        return None
    cls_name, method = head.split(".", 1)
    cls = {"FSDPModule": fsdp_ext.FSDPModule, _PRE: fsdp_ext.FullyShardedDataParallel,
           "UnshardHandle": fsdp_ext.UnshardHandle}.get(cls_name)
    return getattr(cls, method, None) if cls is not None else None


def problems() -> list[str]:
    found = []
    names = torch_names()
    for name in names:
        if name not in ENTRIES:
            found.append(f"torch name '{name}' is neither tested nor refused: add a row to "
                         "tools/compat.py (and a check that exercises it)")
    for key, (status, check, _) in ENTRIES.items():
        if key not in names:
            found.append(f"'{key}' is listed but the installed torch has no such name (stale)")
        if status not in (TESTED, REFUSED, PARTLY):
            found.append(f"'{key}': unknown status {status!r}")
        if check not in CHECKS:
            found.append(f"'{key}': unknown check {check!r}")
            continue
        path, function = CHECKS[check]
        source = _function_source(path, function)
        if source is None:
            found.append(f"'{key}': {path}::{function} does not exist")
        elif _probe(key) not in source:
            found.append(f"'{key}': {path}::{function} does not mention '{_probe(key)}'")
        cls_name, _, member = key.partition(".")
        if member and "(" not in member and cls_name in ("FSDPModule", "UnshardHandle"):
            import fsdp_ext
            if not callable(getattr(getattr(fsdp_ext, cls_name), member, None)):
                found.append(f"'{key}': fsdp_ext.{cls_name} has no method '{member}'")
        ours = _ours(key)
        if ours is not None and _probe(key) not in inspect.signature(ours).parameters:
            found.append(f"'{key}': fsdp_ext's {key.split('(')[0]} has no parameter "
                         f"'{_probe(key)}'")
    return found


# ---- the page -------------------------------------------------------------------------------------
_SECTIONS = [
    ("`torch.distributed.fsdp` names", lambda k: k.startswith("fsdp.")),
    ("Wrap policies (`torch.distributed.fsdp.wrap`)", lambda k: k.startswith("wrap.")),
    ("`fully_shard` arguments", lambda k: k.startswith("fully_shard(")),
    ("`replicate` (`torch.distributed._composable.replicate_with_fsdp`: FSDP2-based DDP)",
     lambda k: k.startswith(("replicate", "ReplicateModule"))),
    ("`FSDPModule` / `UnshardHandle` methods",
     lambda k: k.startswith(("FSDPModule.", "UnshardHandle."))),
    ("`FullyShardedDataParallel` arguments", lambda k: k.startswith(f"{_PRE}(")),
    ("`FullyShardedDataParallel` methods and attributes", lambda k: k.startswith(f"{_PRE}.")),
    ("Enum members and option fields", lambda k: True),
]


def render() -> str:
    import torch
    lines = [
        "# Compatibility with torch's FSDP APIs",
        "",
        f"Generated by `python tools/compat.py` from the installed torch ({torch.__version__}); "
        "`tests/api/test_compat.py` fails when this page is stale or when torch has a name that is "
        "neither tested nor refused. **tested**: does what torch's documentation says, checked "
        "against torch's FSDP1/FSDP2 (or the unwrapped model) on the same script at world 2 and "
        "3 by the named check; **refused**: raises `NotImplementedError` at the call naming the "
        "option, with what to do instead (checked by the named test); **partly**: some values "
        "honoured, the others refused, as the note says. Nothing is accepted and ignored.",
        "",
    ]
    counts = {s: sum(1 for v in ENTRIES.values() if v[0] == s) for s in (TESTED, PARTLY, REFUSED)}
    lines.append(f"{len(ENTRIES)} names: {counts[TESTED]} tested, {counts[PARTLY]} partly, "
                 f"{counts[REFUSED]} refused.")
    lines.append("")
    done: set[str] = set()
    for title, match in _SECTIONS:
        keys = [k for k in ENTRIES if k not in done and match(k)]
        done.update(keys)
        lines += [f"## {title}", "", "| torch name | fsdp_ext | checked by | note |",
                  "|---|---|---|---|"]
        for key in keys:
            status, check, note = ENTRIES[key]
            path, function = CHECKS[check]
            lines.append(f"| `{key}` | {status} | `{os.path.basename(path)}::{function}` | "
                         f"{note} |")
        lines.append("")
    lines += ["## Known differences", ""] + [f"- {d}" for d in DIFFERENCES] + [""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="report problems and a stale docs/compat.md instead of writing it")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    page = render()
    if not args.check:
        with open(DOC, "w") as f:
            f.write(page)
        print(f"wrote {DOC}")
        return 0
    found = problems()
    with open(DOC) as f:
        if f.read() != page:
            found.append("docs/compat.md is stale: run `python tools/compat.py`")
    for problem in found:
        print(problem)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
