"""Every FSDPModule method and fully_shard argument of torch's FSDP2, on the same script under
torch's fully_shard and fsdp_ext's (the namespace passed in is `torch.distributed.fsdp` or
`fsdp_ext`: only the import differs), at world 2 and 3: results equal to torch's, and what
fsdp_ext refuses raises NotImplementedError naming it. docs/compat.md points here.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp_ext
from fsdp_ext.runtime.core.trace import recording

from ..helpers import fsdp2 as scripts
from ..helpers.dist import run_checks, run_distributed

FP32 = dict(atol=1e-6, rtol=1e-5)
FRAMEWORKS = (torch_fsdp, fsdp_ext)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _run(fsdp, rank, world, setup=None, steps=3, micro=1, keep_gathered=False, **shard_kwargs):
    """The script: GPT, blocks then root sharded, `setup(model)` (the methods under test), AdamW,
    `steps` steps of `micro` micro-batches; returns (losses, full parameters, model)."""
    model = scripts.shard(fsdp, scripts.build(), **shard_kwargs)
    if setup is not None:
        setup(model)
    opt = scripts.adamw(model)
    losses = []
    for step in range(steps):
        for m in range(micro):
            last = m == micro - 1
            if micro > 1:
                model.set_requires_gradient_sync(last)
                model.set_is_last_backward(last)
                if keep_gathered:  # torch's recipe: regather nothing between micro-batches
                    model.set_reshard_after_backward(last)
            idx = scripts.batch(step * micro + m, rank, world)
            loss = model(idx, idx)
            loss.backward()
            losses.append(float(scripts.full(loss.detach())))
        opt.step()
        opt.zero_grad()
    return losses, {n: _full(p.detach()).clone() for n, p in model.named_parameters()}, model


def _same(rank, world, what, setup=None, tol=FP32, **kwargs):
    """Run the script under both frameworks; losses and parameters must agree."""
    runs = [_run(f, rank, world, setup, **kwargs) for f in FRAMEWORKS]
    (l_torch, p_torch, _), (l_ours, p_ours, model) = runs
    torch.testing.assert_close(l_ours, l_torch, **tol, msg=lambda m: f"{what}: losses: {m}")
    for name, value in p_torch.items():
        torch.testing.assert_close(p_ours[name], value, **tol,
                                   msg=lambda m: f"{what}: parameter '{name}': {m}")
    return model


def _raises(fn, *needles, exc=NotImplementedError):
    with pytest.raises(exc) as info:
        fn()
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


# ---- checks ------------------------------------------------------------------------------------------
def check_is_torch_fsdp_module(rank, world):
    model = scripts.shard(fsdp_ext, scripts.build())
    assert isinstance(model, torch_fsdp.FSDPModule) and isinstance(model, fsdp_ext.FSDPModule)
    assert isinstance(model.blocks[0], torch_fsdp.FSDPModule)
    assert type(model.blocks[0]) is type(model.blocks[1])  # one FSDP<Orig> class per class
    assert type(model.blocks[0]).__name__ == "FSDPBlock"
    assert not isinstance(model.wte, torch_fsdp.FSDPModule)


def check_unshard_and_reshard(rank, world):
    """unshard(async_op=True) returns a handle; after wait() the module holds full plain
    parameters with torch's values; reshard() brings the DTensors back; forward works after it."""
    for_each = {}
    for fsdp in FRAMEWORKS:
        model = scripts.shard(fsdp, scripts.build())
        block = model.blocks[0]
        handle = block.unshard(async_op=True)
        assert isinstance(handle, torch_fsdp.UnshardHandle), type(handle)
        handle.wait()
        weight = block.attn.qkv.weight
        assert not isinstance(weight, DTensor) and weight.shape == (72, 24), (fsdp, type(weight))
        values = weight.detach().clone()
        assert block.unshard() is None  # already unsharded: returns at once
        idx = scripts.batch(0, rank, world)
        loss = model(idx, idx)
        block.reshard()
        assert isinstance(block.attn.qkv.weight, DTensor)
        for_each[fsdp.__name__] = (values, float(scripts.full(loss.detach())))
    (v_t, l_t), (v_o, l_o) = for_each.values()
    torch.testing.assert_close(v_o, v_t, **FP32)
    assert abs(l_o - l_t) < 1e-5, (l_o, l_t)


def check_gathered_parameters_are_parameters(rank, world):
    """Inside forward and after unshard(), Shard(0) and Shard(1): what a module holds is an
    nn.Parameter (`isinstance`, `get_parameter`) of the full shape, under both frameworks."""
    from torch.distributed.tensor import Shard
    for fsdp in FRAMEWORKS:
        for dim in (0, 1):
            model = scripts.shard(fsdp, scripts.build(), shard_placement_fn=lambda p: Shard(
                min(dim, p.dim() - 1)))
            seen = []

            def inspect(module, args, model=model):
                weight = model.get_parameter("blocks.0.attn.qkv.weight")  # raises if not one
                seen.append((isinstance(module.weight, nn.Parameter), tuple(weight.shape)))
            model.blocks[0].attn.qkv.register_forward_pre_hook(inspect)
            idx = scripts.batch(0, rank, world)
            model(idx, idx).sum().backward()
            assert seen == [(True, (72, 24))], (fsdp.__name__, dim, seen)
            model.blocks[0].unshard()
            weight = model.get_parameter("blocks.0.attn.qkv.weight")
            assert isinstance(weight, nn.Parameter) and weight.shape == (72, 24), fsdp.__name__
            model.blocks[0].reshard()


def check_explicit_prefetch(rank, world):
    """torchtitan's prefetch lists: training equals torch's, and with depth 0 the lists alone
    issue block i+1's all-gather before block i's forward ends."""
    def setup(model):
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
            block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])

    model = _same(rank, world, "explicit prefetch", setup)
    model.set_prefetch_depth(0, 0)
    idx = scripts.batch(0, rank, world)
    with recording() as events:
        model(idx, idx).backward()
    kinds = [(e.kind, e.unit) for e in events]
    assert kinds.index(("all_gather.issue", "blocks.1")) < kinds.index(("forward.end", "blocks.0"))
    _raises(lambda: model.blocks[0].set_modules_to_forward_prefetch([nn.Linear(1, 1)]),
            "FSDPModule", exc=ValueError)


def check_accumulation_knobs(rank, world):
    """Micro-batches with set_requires_gradient_sync / set_is_last_backward, with
    set_reshard_after_backward(False) and set_unshard_in_backward on the root too."""
    _same(rank, world, "no-sync micro-batches", micro=2)

    _same(rank, world, "reshard_after_backward=False", micro=2, keep_gathered=True)

    def no_regather(model):
        for block in model.blocks:
            block.set_reshard_after_forward(False)
        model.set_reshard_after_forward(True, recurse=False)
    _same(rank, world, "set_reshard_after_forward", no_regather)
    model = scripts.shard(fsdp_ext, scripts.build())
    _raises(lambda: model.set_reshard_after_forward(1), "bool", exc=ValueError)


def check_reduction_knobs(rank, world):
    """Divide factor (with sum-only reductions, which gloo can run under torch too), the hook
    on reduced gradients, buffer count, a separate reduce-scatter group, unused params."""
    def divide(model):
        for m in model.modules():
            if isinstance(m, torch_fsdp.FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(1.0)
    _same(rank, world, "set_gradient_divide_factor(1.0)", divide)

    def hook(model):
        for m in model.modules():
            if isinstance(m, torch_fsdp.FSDPModule):
                m.set_all_reduce_hook(lambda out: out.mul_(0.5))
    _same(rank, world, "set_all_reduce_hook", hook)

    def knobs(model):
        model.set_reduce_scatter_max_input_buffers(2, recurse=True)
        model.set_separate_reduce_scatter_group(enable=True, recurse=False)
        model.set_reduce_scatter_unused_params(True, recurse=False)
    ours = _same(rank, world, "reduce-scatter buffers / group / unused params", knobs)
    # recurse=False set the root's unit only
    root, block = ours._unit, ours.blocks[0]._unit
    assert root.groups.reduce_scatter_over(root.separate_reduce_scatter) not in (
        None, root.groups.shard)
    assert block.groups.reduce_scatter_over(block.separate_reduce_scatter) is block.groups.shard
    assert ours.blocks[0]._unit.options.max_pending_reduce_scatters == 2
    model = scripts.shard(fsdp_ext, scripts.build())
    _raises(lambda: model.set_all_reduce_hook(lambda out: None, stream=object()), "stream")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_reduce_scatter_divide_factor(2.0)
    assert any(issubclass(w.category, FutureWarning) for w in caught)
    assert model._unit.gradient_divide_factor == 2.0
    _raises(lambda: model.set_reduce_scatter_max_input_buffers(True), exc=TypeError)
    _raises(lambda: model.set_reduce_scatter_max_input_buffers(0), exc=ValueError)


def check_replicas_defer_all_reduce(rank, world):
    """HSDP over a (world, 1) mesh: set_requires_all_reduce(False) for the first micro-batch."""
    def run(fsdp):
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        model = scripts.shard(fsdp, scripts.build(), mesh=mesh)
        opt = scripts.adamw(model)
        for m in range(2):
            model.set_requires_all_reduce(m == 1, recurse=True)
            idx = scripts.batch(m, rank, world)
            model(idx, idx).backward()
        opt.step()
        return {n: _full(p.detach()) for n, p in model.named_parameters()}
    theirs, ours = run(torch_fsdp), run(fsdp_ext)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, **FP32)


class _EmbedThenMLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(67, 24)
        self.mlp = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 5))

    def forward(self, idx):
        return self.mlp(self.embed(idx)).pow(2).mean()


def check_unshard_in_backward(rank, world):
    """An embedding unit whose backward needs no parameter: not regathered, same gradients."""
    grads = {}
    for fsdp in FRAMEWORKS:
        model = _EmbedThenMLP()
        fsdp.fully_shard(model.embed)
        fsdp.fully_shard(model.mlp)
        fsdp.fully_shard(model)
        model.embed.set_unshard_in_backward(False)
        idx = scripts.batch(0, rank, world)
        with recording() as events:
            model(idx).backward()
        if fsdp is fsdp_ext:
            gathers = [e for e in events if e.kind == "all_gather.issue" and e.unit == "embed"]
            assert len(gathers) == 1, gathers  # forward only
        grads[fsdp.__name__] = {n: _full(p.grad) for n, p in model.named_parameters()}
    for name, value in grads["torch.distributed.fsdp"].items():
        torch.testing.assert_close(grads["fsdp_ext"][name], value, **FP32)


def check_reset_iter_state(rank, world):
    """A forward that raises in a block; reset_iter_state on the root; training goes on as
    torch's does."""
    def run(fsdp):
        model = scripts.shard(fsdp, scripts.build())
        opt = scripts.adamw(model)
        original = model.blocks[1].forward
        model.blocks[1].forward = lambda x: (_ for _ in ()).throw(ValueError("planted"))
        idx = scripts.batch(0, rank, world)
        with pytest.raises(ValueError, match="planted"):
            model(idx, idx)
        model.reset_iter_state()
        model.blocks[1].forward = original
        losses = []
        for step in range(2):
            idx = scripts.batch(step, rank, world)
            loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        return losses
    torch.testing.assert_close(run(fsdp_ext), run(torch_fsdp), **FP32)
    model = scripts.shard(fsdp_ext, scripts.build())
    idx = scripts.batch(0, rank, world)
    model(idx, idx).backward()
    _raises(lambda: model.blocks[0].reset_iter_state(), "root", exc=RuntimeError)


class _GPTWithMethod(nn.Module):
    """A model whose extra method uses root-owned parameters outside forward()."""

    def __init__(self):
        super().__init__()
        self.gpt = scripts.build()

    def forward(self, idx, targets=None):
        return self.gpt(idx, targets)

    def embed(self, idx):
        return self.gpt.wte(idx).sum(-1)


def check_forward_methods(rank, world):
    """Without registration a method that uses root parameters outside forward fails with an
    error naming the module; registered (with torch's function or fsdp_ext's) it gives torch's
    values; register_fsdp_forward_method is a no-op on unsharded modules."""
    idx = scripts.batch(0, rank, world)
    values = {}
    for fsdp, register in ((torch_fsdp, torch_fsdp.register_fsdp_forward_method),
                           (fsdp_ext, fsdp_ext.register_fsdp_forward_method),
                           (fsdp_ext, torch_fsdp.register_fsdp_forward_method)):
        model = _GPTWithMethod()
        for block in model.gpt.blocks:
            fsdp.fully_shard(block)
        fsdp.fully_shard(model)  # the root owns gpt.wte
        if fsdp is fsdp_ext and register is fsdp_ext.register_fsdp_forward_method:
            _raises(lambda: model.embed(idx), "Embedding 'gpt.wte'", "register_fsdp_forward_method",
                    exc=RuntimeError)
        register(model, "embed")
        out = model.embed(idx)
        out.sum().backward()
        values.setdefault(fsdp.__name__, []).append(
            (out.detach(), _full(model.gpt.wte.weight.grad)))
        model(idx, idx)  # forward still works afterwards
    (out_t, grad_t), = values["torch.distributed.fsdp"]
    for out, grad in values["fsdp_ext"]:
        torch.testing.assert_close(out, out_t, **FP32)
        torch.testing.assert_close(grad, grad_t, **FP32)
    plain = nn.Linear(2, 2)
    fsdp_ext.register_fsdp_forward_method(plain, "forward")  # no-op, as torch's
    assert plain.forward.__func__ is nn.Linear.forward
    _raises(lambda: fsdp_ext.register_fsdp_forward_method(scripts.shard(fsdp_ext, scripts.build()),
                                                          "nope"), "nope", exc=ValueError)


def check_ignored_params_and_policies(rank, world):
    """ignored_params stay plain tensors with local gradients, as torch's; torch's default
    OffloadPolicy() object and its MixedPrecisionPolicy class are read as torch reads them."""
    grads = {}
    for fsdp in FRAMEWORKS:
        model = scripts.build()
        ignored = {model.wpe.weight}
        for block in model.blocks:
            fsdp.fully_shard(block, offload_policy=fsdp.OffloadPolicy())
        fsdp.fully_shard(model, ignored_params=ignored,
                         mp_policy=fsdp.MixedPrecisionPolicy(reduce_dtype=torch.float32))
        assert not isinstance(model.wpe.weight, DTensor) and isinstance(model.wte.weight, DTensor)
        idx = scripts.batch(0, rank, world)
        model(idx, idx).backward()
        grads[fsdp.__name__] = {n: _full(p.grad) for n, p in model.named_parameters()}
    for name, value in grads["torch.distributed.fsdp"].items():
        torch.testing.assert_close(grads["fsdp_ext"][name], value, **FP32)
    _raises(lambda: fsdp_ext.fully_shard(nn.Linear(2, 2), offload_policy=object()),
            "offload_policy", exc=TypeError)
    _raises(lambda: fsdp_ext.fully_shard(nn.Linear(2, 2), mp_policy=object()), "mp_policy",
            exc=TypeError)


def check_comm_ctx_and_post_optim_event(rank, world):
    def setup(model):
        fsdp_ext.share_comm_ctx([model.blocks[0], model.blocks[1]]) if isinstance(
            model, fsdp_ext.FSDPModule) else torch_fsdp.share_comm_ctx([model.blocks[0],
                                                                       model.blocks[1]])
    _same(rank, world, "share_comm_ctx", setup)
    model = scripts.shard(fsdp_ext, scripts.build())
    idx = scripts.batch(0, rank, world)
    model(idx, idx).backward()
    model.set_post_optim_event(torch.Event("cpu") if hasattr(torch, "Event") else None)
    model(idx, idx).backward()  # the event is taken (nothing to order on CPU), training goes on
    assert model._unit.schedule.post_optim_event is None


def check_refused(rank, world):
    """What fsdp_ext does not implement raises NotImplementedError naming it, at the call."""
    model = scripts.shard(fsdp_ext, scripts.build())
    _raises(lambda: model.set_custom_all_gather(object()), "set_custom_all_gather")
    _raises(lambda: model.set_custom_reduce_scatter(object()), "set_custom_reduce_scatter")
    _raises(lambda: model.set_symm_mem_for_comm(backend="NCCL"), "set_symm_mem_for_comm")
    _raises(lambda: model.set_allocate_memory_from_process_group_for_comm(True),
            "set_allocate_memory_from_process_group_for_comm")
    model.set_allocate_memory_from_process_group_for_comm(False)  # the default: accepted
    outer = nn.Sequential(nn.Linear(2, 2))
    _raises(lambda: fsdp_ext.fully_shard([outer, outer[0]]), "module 1 (Linear) is inside module 0",
            exc=ValueError)
    pair = [nn.Linear(2, 2), nn.Linear(2, 2)]
    fsdp_ext.fully_shard(pair)
    _raises(lambda: pair[0](torch.ones(1, 2)), "cannot be the root")


def check_fully_shard_arguments(rank, world):
    """Every fully_shard argument with torch's own objects, each against torch on the same script:
    an explicit mesh, reshard_after_forward as bool and int, shard_placement_fn giving Shard(0),
    MixedPrecisionPolicy's fields (param_dtype, reduce_dtype, output_dtype,
    cast_forward_inputs) and CPUOffloadPolicy(pin_memory=False)."""
    from torch.distributed.tensor import Shard
    mesh = init_device_mesh("cpu", (world,))
    _same(rank, world, "mesh", mesh=mesh)
    for value in (False, 1, world):  # torch: 1 keeps nothing sharded (= False), world = True
        _same(rank, world, f"reshard_after_forward={value}", reshard_after_forward=value)
    _same(rank, world, "shard_placement_fn", shard_placement_fn=lambda param: Shard(0))
    bf16 = dict(atol=3e-2, rtol=3e-2)
    for fields in (dict(cast_forward_inputs=False), dict(reduce_dtype=torch.bfloat16)):
        policy = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, **fields)
        _same(rank, world, f"MixedPrecisionPolicy({fields})", tol=bf16, mp_policy=policy)
    logits = {}
    for fsdp in FRAMEWORKS:  # output_dtype on the root: bf16 compute, fp32 logits
        model = scripts.build()
        for block in model.blocks:
            fsdp.fully_shard(block, mp_policy=torch_fsdp.MixedPrecisionPolicy(torch.bfloat16))
        fsdp.fully_shard(model, mp_policy=torch_fsdp.MixedPrecisionPolicy(
            torch.bfloat16, output_dtype=torch.float32))
        idx = scripts.batch(0, rank, world)
        logits[fsdp.__name__] = model(idx)
    (theirs, ours) = logits.values()
    assert ours.dtype == theirs.dtype == torch.float32, (ours.dtype, theirs.dtype)
    torch.testing.assert_close(ours, theirs, **bf16)
    _same(rank, world, "CPUOffloadPolicy", offload_policy=torch_fsdp.CPUOffloadPolicy(
        pin_memory=False))


def _list_units_script(fsdp, rank, world, steps=3):
    """GPT with untied head; blocks sharded one by one, the embeddings and the final norm + head
    as two lists (accelerate's FSDP2 does the latter), then the root. Returns (losses, parameters,
    full state dict, eval logits, model, fsdp_ext's describe() before the first forward)."""
    model = scripts.build()
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard([model.wte, model.wpe])
    fsdp.fully_shard([model.ln_f, model.lm_head])
    fsdp.fully_shard(model)
    plan = fsdp_ext.describe(model, file=None) if fsdp is fsdp_ext else ""  # before any forward
    opt = scripts.adamw(model)
    losses = []
    for step in range(steps):
        idx = scripts.batch(step, rank, world)
        loss = model(idx, idx)
        loss.backward()
        losses.append(float(scripts.full(loss.detach())))
        opt.step()
        opt.zero_grad()
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    state = {k: _full(v) for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(scripts.batch(0, rank, world))
    return losses, params, state, logits, model, plan


def check_list_units(rank, world):
    """fully_shard([m1, m2]) (its `module` argument a list): training, parameter names, state
    dict and no-grad forward equal to torch's; both members are one unit gathered by one
    all-gather per use, and unshard() on a member gathers the other too (as torch's)."""
    (l_t, p_t, s_t, o_t, _, _), (l_o, p_o, s_o, o_o, model, plan) = (
        _list_units_script(f, rank, world) for f in FRAMEWORKS)
    torch.testing.assert_close(l_o, l_t, **FP32)
    assert list(p_o) == list(p_t) and list(s_o) == list(s_t), (list(p_o), list(s_o))
    for name, value in {**p_t, **s_t}.items():
        torch.testing.assert_close({**p_o, **s_o}[name], value, **FP32,
                                   msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(o_o, o_t, **FP32)
    full = fsdp_ext.full_state_dict(model)  # each list member's hook gathers its own parameters
    assert list(full) == list(s_t), list(full)
    for name, value in s_t.items():
        torch.testing.assert_close(full[name], value, **FP32, msg=lambda m: f"full {name}: {m}")
    unit = model.ln_f._unit
    assert model.lm_head._unit is unit and unit.name == "[ln_f, lm_head]", unit.name
    assert isinstance(model.ln_f, torch_fsdp.FSDPModule) and isinstance(model.lm_head, nn.Linear)
    idx = scripts.batch(0, rank, world)
    with recording() as events:
        model(idx, idx).backward()
    for name in ("[wte, wpe]", "[ln_f, lm_head]"):
        issued = [e for e in events if e.kind == "all_gather.issue" and e.unit == name]
        forwards = [e for e in events if e.kind == "forward.begin" and e.unit == name]
        assert len(forwards) == 1 and len(issued) <= 2, (name, len(forwards), len(issued))
    for plan in (plan, fsdp_ext.describe(model, file=None)):  # before and after the first forward
        assert plan.count("unit '[ln_f, lm_head]' (LayerNorm+Linear)") == 1, plan
        assert "ln_f.weight " in plan and "lm_head.weight " in plan, plan
    model.lm_head.unshard()
    assert not isinstance(model.ln_f.weight, DTensor) and model.ln_f.weight.shape == (24,)
    model.lm_head.reshard()
    assert isinstance(model.ln_f.weight, DTensor)
    partial = [_partial_list_script(f, rank, world) for f in FRAMEWORKS]
    torch.testing.assert_close(partial[1], partial[0], **FP32)


class _TwoHeads(nn.Module):
    """`b` runs only when asked; `a` under activation checkpointing."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x, use_b):
        x = torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False)
        return self.c(self.b(x) if use_b else x)


def _partial_list_script(fsdp, rank, world):
    """A list unit one of whose members does not run in some steps (torch completes its
    post-forward at the root's), its other member recomputed in backward: the losses."""
    torch.manual_seed(0)
    net = _TwoHeads()
    fsdp.fully_shard([net.a, net.b])
    fsdp.fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for step in range(4):
        x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(step))[rank::world]
        loss = net(x, use_b=step % 2 == 1).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            losses.append(float(net(x, use_b=step % 2 == 0).sum()))
    return losses


def check_units_that_never_run(rank, world):
    """A container whose forward never runs (a ModuleList given to fully_shard) fails at the first
    child's call, naming it (torch's fails in DTensor dispatch); a unit skipped in a step is named
    once at that step's end, and the others train as torch's do."""
    model = scripts.build()
    fsdp_ext.fully_shard(model.blocks)
    fsdp_ext.fully_shard(model)
    idx = scripts.batch(0, rank, world)
    _raises(lambda: model(idx, idx), "'blocks.0.", "was called while its parameters are "
            "sharded", "ModuleList", exc=RuntimeError)

    class Skips(nn.Module):  # the second block runs only when asked
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, use_b=False):
            x = self.a(x)
            return self.b(x) if use_b else x

    for use_b in (False, True):
        net = Skips()
        fsdp_ext.fully_shard(net.a)
        fsdp_ext.fully_shard(net.b)
        fsdp_ext.fully_shard(net)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                net(torch.ones(2, 4), use_b).sum().backward()
        said = [str(w.message) for w in caught if "took no part in this step" in str(w.message)]
        expected = [] if use_b else ["unit 'b' (Linear)"]
        assert len(said) == len(expected) and all(e in m for e, m in zip(expected, said)), said
        assert (net.b.weight.grad is None) != use_b and net.a.weight.grad is not None


CHECKS = [check_is_torch_fsdp_module, check_unshard_and_reshard, check_explicit_prefetch,
          check_accumulation_knobs, check_reduction_knobs, check_replicas_defer_all_reduce,
          check_unshard_in_backward, check_reset_iter_state, check_forward_methods,
          check_ignored_params_and_policies, check_comm_ctx_and_post_optim_event, check_refused,
          check_units_that_never_run, check_fully_shard_arguments, check_list_units,
          check_gathered_parameters_are_parameters]


def _worker(rank, world):
    run_checks(CHECKS, rank, world)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fsdp2_surface_against_torch(world_size):
    run_distributed(_worker, world_size, timeout_s=240)
