"""FSDP1 scripts under torch's FullyShardedDataParallel and fsdp_ext's, only the import changed
(`torch.distributed.fsdp` or `fsdp_ext` as the namespace; torch's FSDP1 needs `device_id` on
CPU, so every script passes it), at world 2 and 3: torch's own enums, dataclasses and policies
give torch's results (losses, parameters, the units chosen, attributes), the state-dict types and
optimizer state-dict functions interchange, and what is refused raises NotImplementedError naming
it. docs/compat.md points here.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.fsdp import wrap as torch_wrap

import fsdp_ext
from examples.models import Block

from ..helpers import fsdp2 as scripts
from ..helpers.dist import run_checks, run_distributed

FP32 = dict(atol=1e-6, rtol=1e-5)
CPU = torch.device("cpu")
FRAMEWORKS = (torch_fsdp, fsdp_ext)


def _wrap(fsdp, model=None, **kwargs):
    kwargs.setdefault("auto_wrap_policy", fsdp.ModuleWrapPolicy({Block}) if hasattr(
        fsdp, "ModuleWrapPolicy") else torch_wrap.ModuleWrapPolicy({Block}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's FSDP1 deprecation and world-1 notices
        return fsdp.FullyShardedDataParallel(model if model is not None else scripts.build(),
                                             device_id=CPU, **kwargs)


def _train(model, rank, world, steps=3, opt=None, clip=None):
    opt = opt or scripts.adamw(model)
    losses = []
    for step in range(steps):
        idx = scripts.batch(step, rank, world)
        loss = model(idx, idx)
        loss.backward()
        if clip is not None:
            losses.append(float(model.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(scripts.full(loss.detach())))
    return losses, opt


def _full_params(fsdp, model):
    with fsdp.FullyShardedDataParallel.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in model.state_dict().items()}


class each:
    """An argument built per framework: `each(lambda fsdp: fsdp.MixedPrecision(...))`."""

    def __init__(self, build):
        self.build = build


def _same(rank, world, what, tol=FP32, steps=3, build=scripts.build, **kwargs):
    runs = {}
    for fsdp in FRAMEWORKS:
        options = {k: (v.build(fsdp) if isinstance(v, each) else v) for k, v in kwargs.items()}
        model = _wrap(fsdp, build(), **options)
        losses, _ = _train(model, rank, world, steps)
        runs[fsdp.__name__] = (losses, _full_params(fsdp, model), model)
    (l_t, p_t, _), (l_o, p_o, model) = runs.values()
    torch.testing.assert_close(l_o, l_t, **tol, msg=lambda m: f"{what}: losses: {m}")
    assert list(p_o) == list(p_t), (what, list(p_o), list(p_t))
    for key, value in p_t.items():
        torch.testing.assert_close(p_o[key], value, **tol, msg=lambda m: f"{what}: '{key}': {m}")
    return model, runs["torch.distributed.fsdp"][2]


def _raises(fn, *needles, exc=NotImplementedError):
    with pytest.raises(exc) as info:
        fn()
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def _units(model) -> set[str]:
    """Names of the modules that are units (fsdp_ext) or FSDP instances (torch), root excluded."""
    if isinstance(model, fsdp_ext.FullyShardedDataParallel):
        return {name.replace("._fsdp_wrapped_module", "") for name, m in
                model.module.named_modules()
                if name and fsdp_ext.FullyShardedDataParallel.fsdp_modules(m, root_only=True)
                and getattr(m, "_unit", None) is not None}
    return {name.replace("_fsdp_wrapped_module.", "") for name, m in model.named_modules()
            if isinstance(m, torch_fsdp.FullyShardedDataParallel) and m is not model}


# ---- checks ------------------------------------------------------------------------------------------
def check_sharding_strategies(rank, world):
    """torch's own ShardingStrategy members, each with its meaning (a copy of fsdp_ext's enum used
    to pass for another member before)."""
    S = torch_fsdp.ShardingStrategy
    for strategy in (S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD):
        ours, theirs = _same(rank, world, strategy.name, sharding_strategy=strategy)
        assert ours.sharding_strategy is strategy and theirs.sharding_strategy is strategy
        unit = ours.module.blocks[0]._unit
        if strategy is S.NO_SHARD:  # every rank holds every element
            assert unit.groups.shard is None
            assert unit.buckets[0].shard_numel == unit.buckets[0].full_numel
        else:
            assert unit.groups.shard_size == world
        idx = scripts.batch(0, rank, world)
        ours(idx, idx)
        kept = unit.holds_unsharded_memory()
        assert kept == (strategy is not S.FULL_SHARD), (strategy, kept)  # reshard after forward?
        ours.zero_grad()
    _raises(lambda: _wrap(fsdp_ext, sharding_strategy="FULL_SHARD"), "ShardingStrategy",
            exc=TypeError)


def check_backward_prefetch_and_flags(rank, world):
    P = torch_fsdp.BackwardPrefetch
    for prefetch in (P.BACKWARD_PRE, P.BACKWARD_POST, None):
        ours, _ = _same(rank, world, f"backward_prefetch={prefetch}", backward_prefetch=prefetch,
                        forward_prefetch=True, limit_all_gathers=False, steps=1)
        options = ours.module._unit.schedule.options
        assert options.backward_prefetch_at == {P.BACKWARD_POST: "post"}.get(prefetch, "pre")
        assert options.backward_prefetch == (0 if prefetch is None else 1)
        assert ours.backward_prefetch is prefetch and ours.forward_prefetch is True


def check_mixed_precision_and_offload(rank, world):
    bf16 = dict(atol=3e-2, rtol=3e-2)
    _same(rank, world, "MixedPrecision bf16", bf16, mixed_precision=each(lambda f: f.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)))
    # torch's FSDP1 pins offloaded shards, which needs a GPU: its reference run keeps them
    # on the (CPU) device, the same numbers.
    _same(rank, world, "CPUOffload",
          cpu_offload=each(lambda f: f.CPUOffload(offload_params=f is fsdp_ext)))
    _raises(lambda: _wrap(fsdp_ext, mixed_precision=fsdp_ext.MixedPrecision(
        param_dtype=torch.bfloat16, keep_low_precision_grads=True)), "keep_low_precision_grads")


class _ConvNet(nn.Module):
    """BatchNorm inside a mixed-precision model: FSDP1 keeps it a full-precision unit."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))

    def forward(self, x):
        return self.body(x).pow(2).mean()


def check_batchnorm_stays_full_precision(rank, world):
    results = {}
    for fsdp in FRAMEWORKS:
        model = _wrap(fsdp, _ConvNet(), auto_wrap_policy=torch_wrap.ModuleWrapPolicy({nn.Linear}),
                      mixed_precision=fsdp.MixedPrecision(param_dtype=torch.bfloat16))
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
        loss = model(x)
        loss.backward()
        results[fsdp.__name__] = (float(loss), _units(model))
    (l_t, u_t), (l_o, u_o) = results.values()
    assert u_o == u_t == {"body.0", "body.1", "body.2"}, (u_o, u_t)
    assert abs(l_o - l_t) < 1e-2 * max(1.0, abs(l_t)), (l_o, l_t)


def check_wrap_policies(rank, world):
    """torch's own policy callables and objects pick the same units as under torch's FSDP1; a
    ModuleList is never a unit."""
    policies = {
        "size_based": functools.partial(torch_wrap.size_based_auto_wrap_policy,
                                        min_num_params=5_000),
        "transformer": functools.partial(torch_wrap.transformer_auto_wrap_policy,
                                         transformer_layer_cls={Block}),
        "lambda": functools.partial(torch_wrap.lambda_auto_wrap_policy,
                                    lambda_fn=lambda m: isinstance(m, nn.LayerNorm)),
        "always": torch_wrap.always_wrap_policy,
        "module": torch_wrap.ModuleWrapPolicy({Block, nn.LayerNorm}),
        "custom": torch_wrap.CustomPolicy(
            lambda m: {"sharding_strategy": torch_fsdp.ShardingStrategy.SHARD_GRAD_OP}
            if isinstance(m, Block) else False),
    }
    def untied():  # wrapping every module separates the tied embedding and head: untie them
        model = scripts.build()
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        return model

    for name, policy in policies.items():
        ours, theirs = _same(rank, world, f"{name} policy", auto_wrap_policy=policy, steps=2,
                             build=untied if name == "always" else scripts.build)
        # torch's always_wrap_policy makes the ModuleList an FSDP instance too, holding nothing
        # once its children are wrapped; fsdp_ext never makes a container whose forward does
        # not run a unit.
        assert _units(ours) == _units(theirs) - {"blocks"}, (name, _units(ours), _units(theirs))
        assert "blocks" not in _units(ours), name
    assert ours.module.blocks[0]._unit.reshard_after_forward is False  # CustomPolicy's override
    assert fsdp_ext.size_based_auto_wrap_policy is torch_wrap.size_based_auto_wrap_policy


def check_ignored_and_orig_params(rank, world):
    for key in ("ignored_modules", "ignored_states"):
        runs = {}
        for fsdp in FRAMEWORKS:
            model = scripts.build()
            model = _wrap(fsdp, model, **{key: [model.wpe]}, use_orig_params=True)
            losses, _ = _train(model, rank, world, 2)
            runs[fsdp.__name__] = (losses, model.module.wpe.weight.detach().clone())
        (l_t, w_t), (l_o, w_o) = runs.values()
        torch.testing.assert_close(l_o, l_t, **FP32)
        torch.testing.assert_close(w_o, w_t, **FP32)  # unsharded, updated from local grads
        assert w_o.shape == (8, 24)
    for orig in (False, True):
        _same(rank, world, f"use_orig_params={orig}", use_orig_params=orig, steps=2)


def check_attributes(rank, world):
    ours, theirs = _same(rank, world, "defaults", steps=1)
    for attr in ("sharding_strategy", "backward_prefetch", "forward_prefetch",
                 "limit_all_gathers", "rank", "world_size", "mixed_precision", "cpu_offload"):
        assert getattr(ours, attr) == getattr(theirs, attr), (attr, getattr(ours, attr),
                                                             getattr(theirs, attr))
    assert ours.compute_device == theirs.compute_device == CPU  # _wrap passes device_id=CPU
    assert fsdp_ext.FullyShardedDataParallel(scripts.build(), device_id=None).compute_device == CPU
    assert ours.training_state == theirs.training_state
    assert ours.check_is_root() and theirs.check_is_root()
    assert dist.get_world_size(ours.process_group) == dist.get_world_size(theirs.process_group)
    assert len(fsdp_ext.FullyShardedDataParallel.fsdp_modules(ours)) == len(
        torch_fsdp.FullyShardedDataParallel.fsdp_modules(theirs))
    assert len(fsdp_ext.FullyShardedDataParallel.fsdp_modules(ours, root_only=True)) == 1
    _raises(lambda: ours.params, "FlatParameter")
    _raises(lambda: ours.register_comm_hook(None, lambda *a: None), "register_comm_hook")


def check_summon_and_apply(rank, world):
    results = {}
    for fsdp in FRAMEWORKS:
        F = fsdp.FullyShardedDataParallel
        model = _wrap(fsdp, use_orig_params=True)
        idx = scripts.batch(0, rank, world)
        model(idx, idx).backward()
        seen = {}
        with F.summon_full_params(model, with_grads=True):
            seen["grad"] = model.module.blocks[0].attn.qkv.weight.grad.clone()
            seen["weight"] = model.module.blocks[0].attn.qkv.weight.detach().clone()
        with F.summon_full_params(model, rank0_only=True, writeback=False, offload_to_cpu=True):
            seen["rank0"] = tuple(model.module.blocks[0].attn.qkv.weight.shape)
        with F.summon_full_params(model.module.blocks[0], recurse=False):
            seen["own"] = tuple(model.module.blocks[0].attn.qkv.weight.shape)
            model.module.blocks[0].ln1.bias.data.fill_(0.25)  # written back
        model.apply(lambda m: nn.init.constant_(m.weight, 0.5) if isinstance(m, nn.LayerNorm)
                    else None)
        results[fsdp.__name__] = (seen, _full_params(fsdp, model))
        _raises(lambda: F.summon_full_params(model, rank0_only=True).__enter__(),
                exc=(NotImplementedError, ValueError))
    (s_t, p_t), (s_o, p_o) = results.values()
    torch.testing.assert_close(s_o["grad"], s_t["grad"], **FP32)
    torch.testing.assert_close(s_o["weight"], s_t["weight"], **FP32)
    assert s_o["rank0"] == s_t["rank0"] and s_o["own"] == s_t["own"] == (72, 24), (s_o, s_t)
    for key, value in p_t.items():
        torch.testing.assert_close(p_o[key], value, **FP32, msg=lambda m: f"{key}: {m}")


def check_state_dict_types(rank, world):
    T = torch_fsdp.StateDictType
    ours, theirs = _same(rank, world, "state dicts", steps=1)
    F, TF = fsdp_ext.FullyShardedDataParallel, torch_fsdp.FullyShardedDataParallel
    for model, cls in ((ours, F), (theirs, TF)):  # FSDP1's defaults
        settings = cls.get_state_dict_type(model)
        assert isinstance(settings, torch_fsdp.StateDictSettings), settings
        assert settings.state_dict_type == T.FULL_STATE_DICT, settings
        assert type(settings.state_dict_config) is torch_fsdp.FullStateDictConfig, settings
        assert type(settings.optim_state_dict_config) is torch_fsdp.FullOptimStateDictConfig
    config = torch_fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    dicts = []
    for model, cls in ((ours, F), (theirs, TF)):
        with cls.state_dict_type(model, T.FULL_STATE_DICT, state_dict_config=config):
            dicts.append(model.state_dict())
    if rank == 0:
        assert list(dicts[0]) == list(dicts[1])
        for key, value in dicts[1].items():
            assert dicts[0][key].device.type == "cpu"
            torch.testing.assert_close(dicts[0][key], value, **FP32)
    else:
        assert dicts[0] == {} and dicts[1] == {}
    F.set_state_dict_type(ours, T.SHARDED_STATE_DICT,
                          state_dict_config=torch_fsdp.ShardedStateDictConfig(offload_to_cpu=True))
    with F.state_dict_type(ours, T.SHARDED_STATE_DICT,
                           torch_fsdp.ShardedStateDictConfig(offload_to_cpu=True)):
        sharded = ours.state_dict()
    fresh = _wrap(fsdp_ext, scripts.build(seed=5))
    with F.state_dict_type(fresh, T.SHARDED_STATE_DICT):
        fresh.load_state_dict(sharded)
    for key, value in _full_params(fsdp_ext, fresh).items():
        torch.testing.assert_close(value, dicts[1].get(key, value) if rank == 0 else value)
    _raises(lambda: F.set_state_dict_type(ours, T.LOCAL_STATE_DICT), "LOCAL_STATE_DICT")
    _raises(lambda: F.set_state_dict_type(ours, T.FULL_STATE_DICT,
                                          torch_fsdp.ShardedStateDictConfig()),
            "FullStateDictConfig", exc=ValueError)


def check_optimizer_state_dicts(rank, world):
    """Every FSDP1 optimizer state-dict function against torch's, then a resumed optimizer
    continues with torch's losses."""
    trained = {}
    for fsdp in FRAMEWORKS:
        model = _wrap(fsdp, use_orig_params=True)
        _, opt = _train(model, rank, world, 2)
        F = fsdp.FullyShardedDataParallel
        full = F.full_optim_state_dict(model, opt)
        rekeyed = (F.rekey_optim_state_dict(full, torch_fsdp.OptimStateKeyType.PARAM_NAME, model)
                   if full else {})  # rank0_only: the other ranks hold {}
        osd = F.optim_state_dict(model, opt)  # FULL by default (torch's)
        trained[fsdp.__name__] = (model, opt, full, rekeyed, osd)
    ours, theirs = trained["fsdp_ext"], trained["torch.distributed.fsdp"]
    # Values are compared with the unwrapped model's optimizer: torch 2.14.1's FSDP1 files most
    # entries of this model under another parameter's name (28 of 28 here).
    reference = scripts.build()
    ref_opt = scripts.adamw(reference)
    for step in range(2):
        idxs = [scripts.batch(step, r, world) for r in range(world)]
        (sum(reference(i, i) for i in idxs) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    expected = {name: ref_opt.state[p] for name, p in reference.named_parameters()}
    tol = dict(atol=1e-5, rtol=1e-4)
    for what, osd in (("full_optim_state_dict", ours[2]), ("optim_state_dict", ours[4])):
        if what == "full_optim_state_dict" and rank != 0:
            assert osd == {} and theirs[2] == {}, what  # rank0_only=True by default
            continue
        assert sorted(osd["state"]) == sorted(theirs[2 if what.startswith("full") else 4]["state"])
        for name, entry in expected.items():
            for key, value in entry.items():
                torch.testing.assert_close(osd["state"][name][key], value, **tol,
                                           msg=lambda m: f"{what} '{name}' {key}: {m}")
    if rank == 0:
        ids = fsdp_ext.FullyShardedDataParallel.rekey_optim_state_dict(
            ours[2], torch_fsdp.OptimStateKeyType.PARAM_ID, ours[0], optim=ours[1])
        theirs_ids = torch_fsdp.FullyShardedDataParallel.rekey_optim_state_dict(
            theirs[2], torch_fsdp.OptimStateKeyType.PARAM_ID, theirs[0], optim=theirs[1])
        assert sorted(ids["state"]) == sorted(theirs_ids["state"]) == list(range(len(expected)))
        assert sorted(ours[3]["state"]) == sorted(theirs[3]["state"])

    def resumed(fsdp, how):
        F = fsdp.FullyShardedDataParallel
        source_model, source_opt, full, _, osd = trained[fsdp.__name__]
        model = _wrap(fsdp, use_orig_params=True)
        model.load_state_dict(_full_params(fsdp, source_model))
        opt = scripts.adamw(model)
        if how == "optim_state_dict_to_load":
            F.optim_state_dict_to_load(model, opt, osd, load_directly=True)
        elif how == "scatter":
            opt.load_state_dict(F.scatter_full_optim_state_dict(full if rank == 0 else None,
                                                                model, optim=opt))
        elif how == "sharded":
            sharded = F.sharded_optim_state_dict(source_model, source_opt)
            opt.load_state_dict(F.flatten_sharded_optim_state_dict(sharded, model, opt))
        losses, _ = _train(model, rank, world, 2, opt=opt)
        return losses
    # Resumed runs continue like the unwrapped model's optimizer, trained on without a break.
    # (torch 2.14.1's FSDP1 round trips do not, here: its second resumed loss is 3.573 where the
    # uninterrupted run has 3.481 at world 2, from the misfiled states noted above.)
    continued = []
    for step in range(2):
        idx = scripts.batch(step, rank, world)
        idxs = [scripts.batch(step, r, world) for r in range(world)]
        continued.append(float(reference(idx, idx)))
        (sum(reference(i, i) for i in idxs) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for how in ("optim_state_dict_to_load", "scatter", "sharded"):
        torch.testing.assert_close(resumed(fsdp_ext, how), continued, **tol,
                                   msg=lambda m: f"resumed via {how}: {m}")
    full_everywhere = fsdp_ext.FullyShardedDataParallel.full_optim_state_dict(
        ours[0], ours[1], rank0_only=False)
    loadable = fsdp_ext.FullyShardedDataParallel.shard_full_optim_state_dict(
        full_everywhere, ours[0], optim=ours[1])
    ours[1].load_state_dict(loadable)
    _raises(lambda: fsdp_ext.FullyShardedDataParallel.full_optim_state_dict(
        ours[0], ours[1], optim_input=[]), "optim_input")


def check_no_sync_and_clip(rank, world):
    runs = {}
    for fsdp in FRAMEWORKS:
        model = _wrap(fsdp)
        opt = scripts.adamw(model)
        with model.no_sync():
            idx = scripts.batch(0, rank, world)
            model(idx, idx).backward()
        losses, _ = _train(model, rank, world, 2, opt=opt, clip=0.5)
        idx = scripts.batch(5, rank, world)
        model(idx, idx).backward()
        norms = [float(model.clip_grad_norm_(0.1, norm_type=kind)) for kind in (1.0, float("inf"))]
        runs[fsdp.__name__] = losses + norms  # the loss-step norms come from clip_grad_norm_
    torch.testing.assert_close(runs["fsdp_ext"], runs["torch.distributed.fsdp"], **FP32)


def check_hybrid_groups_and_manual_wrap(rank, world):
    """HYBRID_SHARD / _HYBRID_SHARD_ZERO2 over a (replicate, shard) device_mesh, an explicit
    process_group, and manual nesting with torch's enable_wrap/wrap, each as under torch."""
    from torch.distributed.device_mesh import init_device_mesh
    S = torch_fsdp.ShardingStrategy
    for strategy in (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2):
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
        ours, _ = _same(rank, world, strategy.name, sharding_strategy=strategy, device_mesh=mesh,
                        steps=2)
        assert ours.module.blocks[0]._unit.groups.shard_size == world, strategy
        # Replicas only (shard size 1): torch 2.14.1's FSDP1 drifts from the unwrapped model here
        # (losses 3.920 / 3.832 where FULL_SHARD and the single process give 3.875 / 3.704 at
        # world 2), so fsdp_ext is compared with torch's FULL_SHARD, which matches the latter.
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        ours, _ = _same(rank, world, f"{strategy.name} replicas", steps=2,
                        sharding_strategy=each(lambda f, s=strategy: s if f is fsdp_ext
                                               else S.FULL_SHARD),
                        device_mesh=each(lambda f, m=mesh: m if f is fsdp_ext else None))
        unit = ours.module.blocks[0]._unit
        assert unit.groups.shard_size == 1 and unit.groups.replicate_size == world, strategy
    group = dist.new_group(list(range(world)))
    ours, _ = _same(rank, world, "process_group", process_group=group, steps=2)
    assert ours.process_group is group

    def manual(fsdp):
        model = scripts.build()
        with torch_wrap.enable_wrap(wrapper_cls=fsdp.FullyShardedDataParallel, device_id=CPU,
                                    use_orig_params=True):
            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch_wrap.wrap(block)
        return fsdp.FullyShardedDataParallel(model, device_id=CPU, use_orig_params=True)
    runs = {}
    for fsdp in FRAMEWORKS:
        model = manual(fsdp)
        # torch's FSDP1 gives the unwrapped names inside summon_full_params (fsdp_ext always)
        with fsdp.FullyShardedDataParallel.summon_full_params(model):
            names = [n for n, _ in model.named_parameters()] + [n for n, _ in
                                                                model.named_buffers()]
        runs[fsdp.__name__] = (_train(model, rank, world, 2)[0], names, _units(model),
                               list(_full_params(fsdp, model)))
    (l_t, n_t, u_t, k_t), (l_o, n_o, u_o, k_o) = runs.values()
    torch.testing.assert_close(l_o, l_t, **FP32)
    assert n_o == n_t == [n for n, _ in scripts.build().named_parameters()], (n_o, n_t)
    assert k_o == k_t, (k_o, k_t)
    assert u_o == u_t == {f"blocks.{i}" for i in range(len(scripts.build().blocks))}, (u_o, u_t)
    assert fsdp_ext.wrap is torch_wrap.wrap and fsdp_ext.enable_wrap is torch_wrap.enable_wrap


def check_mixed_precision_fields(rank, world):
    """cast_root_forward_inputs (the default: only the root casts its inputs), cast_forward_inputs,
    and _module_classes_to_ignore (a class listed there runs in full precision as its own unit)."""
    for fields in (dict(cast_root_forward_inputs=True), dict(cast_forward_inputs=True),
                   dict(_module_classes_to_ignore=(nn.LayerNorm,))):
        _same(rank, world, f"MixedPrecision({fields})", dict(atol=3e-2, rtol=3e-2), steps=2,
              mixed_precision=each(lambda f, fields=fields: f.MixedPrecision(
                  param_dtype=torch.bfloat16, **fields)))


def check_refused_state_dict_options(rank, world):
    """What fsdp_ext does not implement raises at the call, naming it."""
    F = fsdp_ext.FullyShardedDataParallel
    T = torch_fsdp.StateDictType
    model = _wrap(fsdp_ext)
    opt = scripts.adamw(model)
    _raises(lambda: F.set_state_dict_type(model, T.LOCAL_STATE_DICT,
                                          torch_fsdp.LocalStateDictConfig(),
                                          torch_fsdp.LocalOptimStateDictConfig()),
            "LOCAL_STATE_DICT")
    _raises(lambda: F.set_state_dict_type(model, T.SHARDED_STATE_DICT,
                                          torch_fsdp.ShardedStateDictConfig(_use_dtensor=True)),
            "_use_dtensor")
    _raises(lambda: F.optim_state_dict_to_load(model, opt, {}, is_named_optimizer=True),
            "is_named_optimizer")
    _raises(lambda: F.optim_state_dict(model, opt, group=dist.new_group([0])), "group")
    # SHARDED with its optimizer config: per-rank name-keyed state, loadable back.
    F.set_state_dict_type(model, T.SHARDED_STATE_DICT, torch_fsdp.ShardedStateDictConfig(),
                          torch_fsdp.ShardedOptimStateDictConfig(offload_to_cpu=True))
    idx = scripts.batch(0, rank, world)
    model(idx, idx).backward()
    opt.step()
    osd = F.optim_state_dict(model, opt)
    F.optim_state_dict_to_load(model, opt, osd, load_directly=True)
    assert F.get_state_dict_type(model).optim_state_dict_config.offload_to_cpu


CHECKS = [check_sharding_strategies, check_backward_prefetch_and_flags,
          check_mixed_precision_and_offload, check_batchnorm_stays_full_precision,
          check_wrap_policies, check_ignored_and_orig_params, check_attributes,
          check_summon_and_apply, check_state_dict_types, check_optimizer_state_dicts,
          check_no_sync_and_clip, check_hybrid_groups_and_manual_wrap,
          check_mixed_precision_fields, check_refused_state_dict_options]


def _worker(rank, world):
    run_checks(CHECKS, rank, world)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fsdp1_surface_against_torch(world_size):
    run_distributed(_worker, world_size, timeout_s=300)
