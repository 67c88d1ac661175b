"""fully_shard scripts give torch FSDP2's results with fsdp_ext (tests/helpers/fsdp2.py).

Each check runs the same script with torch's fully_shard and with fsdp_ext's and compares:
the DTensor parameters and gradients (spec, global shape, each rank's local chunk), the losses and
torch's clip_grad_norm_ norms step by step and the parameters after training (fp32: to float
rounding; bf16 mixed precision: to bf16 rounding), for FULL_SHARD at worlds 2 and 3, bf16,
reshard_after_forward=False, HSDP on a 2 x 2 mesh and CPU offload at world 4; then torch's
state-dict helpers, DCP checkpoints across frameworks and world sizes, torchtitan's flows
(equal-shape shards through DCP, meta-device init), a Hugging Face Llama through save and resume,
and FSDP x tensor parallelism on a (dp 2, tp 2) mesh.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_ext

from ..helpers import fsdp2 as scripts
from ..helpers.dist import run_distributed

FP32 = dict(atol=1e-6, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=2e-2)


def assert_dtensor_params(model, reference_model, placements, what: str, tol=FP32) -> None:
    """Every parameter and .grad is a DTensor with torch's placements and local chunk, never a
    plain (1-D) tensor; `reference_model` is the same model under torch's fully_shard."""
    theirs = dict(reference_model.named_parameters())
    for name, p in model.named_parameters():
        q = theirs[name]
        assert isinstance(p, DTensor), f"{what}: '{name}' is a {type(p).__name__}"
        assert p.placements == placements == q.placements, (what, name, p.placements, q.placements)
        assert p.shape == q.shape and p.to_local().shape == q.to_local().shape, (
            what, name, p.to_local().shape, q.to_local().shape)
        torch.testing.assert_close(p.to_local(), q.to_local(), **tol,
                                   msg=lambda m: f"{what} '{name}' local values: {m}")
        if p.grad is not None or q.grad is not None:
            assert isinstance(p.grad, DTensor) and p.grad.placements == placements, (what, name)
            assert p.grad.to_local().shape == q.grad.to_local().shape, (what, name)


def same_script(rank: int, world_size: int, what: str, placements, tol=FP32, **kwargs) -> None:
    """The script: build, shard blocks then root, train 3 steps with torch's clip."""
    runs = {}
    for fsdp in (scripts.torch_fsdp(), scripts.ours()):
        options = {k: (v(fsdp) if callable(v) else v) for k, v in kwargs.items()}
        model = scripts.shard(fsdp, scripts.build(), **options)
        opt = scripts.adamw(model)
        trace = scripts.train(model, opt, 1, rank, world_size, clip=None)
        idx = scripts.batch(9, rank, world_size)
        model(idx, idx).backward()  # gradients left in place, to compare
        runs[fsdp.name] = (model, opt, trace)
    ours, theirs = runs["fsdp_ext"][0], runs["torch"][0]
    assert_dtensor_params(ours, theirs, placements, what, tol)
    for name in ("fsdp_ext", "torch"):
        model, opt, trace = runs[name]
        opt.zero_grad()
        trace += scripts.train(model, opt, 3, rank, world_size, first_step=1)
    for (loss, norm), (ref_loss, ref_norm) in zip(runs["fsdp_ext"][2], runs["torch"][2]):
        torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"{what} loss: {m}")
        if norm is not None:
            torch.testing.assert_close(norm, ref_norm, **tol, msg=lambda m: f"{what} norm: {m}")
    params, ref_params = scripts.full_params(ours), scripts.full_params(theirs)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, **tol, msg=lambda m: f"{what} {name}: {m}")


def same_script_worker(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    same_script(rank, world_size, "FULL_SHARD", (Shard(0),), mesh=mesh)
    same_script(rank, world_size, "reshard_after_forward=False", (Shard(0),), mesh=mesh,
                reshard_after_forward=False)
    same_script(rank, world_size, "bf16", (Shard(0),), tol=BF16, mesh=mesh,
                mp_policy=lambda f: f.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32))
    if world_size == 4:
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        same_script(rank, world_size, "HSDP", (Replicate(), Shard(0)), mesh=hsdp)
        same_script(rank, world_size, "CPU offload", (Shard(0),), mesh=mesh,
                    offload_policy=lambda f: f.CPUOffloadPolicy(pin_memory=False))
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow),
                                        pytest.param(4, marks=pytest.mark.slow)])
def test_same_script_as_torch_fsdp2(world_size):
    run_distributed(same_script_worker, world_size)


def same_gradient_bits_worker(rank: int, world_size: int) -> None:
    """One backward of the same script under torch's fully_shard and fsdp_ext's: every local
    gradient chunk equal bit for bit, for fp32 and bf16 reductions. At world 3 the post-divide
    is not a power of two: torch divides (gloo's AVG) in the reduce dtype, and a multiply by 1/3
    differs in about a third of the values (up to 3e-8 in fp32, an ulp of bf16 in bf16)."""
    mesh = init_device_mesh("cpu", (world_size,))
    for reduce_dtype in (None, torch.bfloat16):
        grads = {}
        for fsdp in (scripts.torch_fsdp(), scripts.ours()):
            mp = fsdp.MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
            model = scripts.shard(fsdp, scripts.build(), mesh=mesh, mp_policy=mp)
            for step in range(2):  # the second backward accumulates into the first's gradients
                idx = scripts.batch(step, rank, world_size)
                model(idx, idx).backward()
            grads[fsdp.name] = {n: p.grad.to_local() for n, p in model.named_parameters()}
        for name, expected in grads["torch"].items():
            got = grads["fsdp_ext"][name]
            differ = int((got.view(torch.int32) != expected.view(torch.int32)).sum())
            assert differ == 0, (reduce_dtype, name, f"{differ} of {got.numel()} values differ",
                                 float((got - expected).abs().max()))
    dist.barrier()


# Slow, as the other world-3 launches: the default tier checks the epilogue's division against
# torch's own (test_ops_cpp.py::test_grad_epilogue_divides_as_torch).
@pytest.mark.slow
def test_gradients_bit_equal_to_torch_fsdp2_at_world_3():
    run_distributed(same_gradient_bits_worker, 3)


# ---- torch's state-dict helpers --------------------------------------------------------------------
def check_same_optimizer_state(osd: dict, ref_osd: dict) -> None:
    assert osd["param_groups"] == ref_osd["param_groups"]
    assert list(osd["state"]) == list(ref_osd["state"])
    for fqn, state in ref_osd["state"].items():
        assert list(osd["state"][fqn]) == list(state), fqn
        for key, value in state.items():
            torch.testing.assert_close(scripts.full(osd["state"][fqn][key]), scripts.full(value),
                                       **FP32, msg=lambda m: f"optim {fqn}.{key}: {m}")


def state_dict_helpers_worker(rank: int, world_size: int) -> None:
    """get/set_model_state_dict, get/set_optimizer_state_dict and get/set_state_dict with
    full_state_dict / cpu_offload / broadcast_from_rank0 / strict=False: fsdp_ext's results equal
    torch FSDP2's, and training resumed from them continues with the same losses."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict,
        set_model_state_dict, set_optimizer_state_dict, set_state_dict)
    mesh = init_device_mesh("cpu", (world_size,))
    trained = {}
    for fsdp in (scripts.torch_fsdp(), scripts.ours()):
        model = scripts.shard(fsdp, scripts.build(), mesh=mesh)
        opt = scripts.adamw(model)
        scripts.train(model, opt, 2, rank, world_size)
        trained[fsdp.name] = (fsdp, model, opt)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    got = {name: (get_model_state_dict(model, options=full),
                  get_optimizer_state_dict(model, opt, options=full))
           for name, (_, model, opt) in trained.items()}
    (msd, osd), (ref_msd, ref_osd) = got["fsdp_ext"], got["torch"]
    assert list(msd) == list(ref_msd), (list(msd), list(ref_msd))
    assert (osd == {}) == (ref_osd == {}), "full optimizer state on other ranks: as torch's"
    if rank == 0:
        check_same_optimizer_state(osd, ref_osd)
    for key, value in ref_msd.items():
        assert msd[key].device.type == "cpu" and not isinstance(msd[key], DTensor), key
        torch.testing.assert_close(msd[key], value, **FP32, msg=lambda m: f"model {key}: {m}")
    # Sharded (default) form: DTensors, like torch's.
    sharded = get_model_state_dict(trained["fsdp_ext"][1])
    assert all(isinstance(v, DTensor) for v in sharded.values())

    # Resume from the full dicts into fresh models: rank 0's copy broadcast, then both trainings go on.
    continued = {}
    for name, (fsdp, _, _) in trained.items():
        model = scripts.shard(fsdp, scripts.build(seed=1), mesh=mesh)
        opt = scripts.adamw(model)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        # (torch's helpers turn the given dicts' tensors into DTensors in place: pass copies)
        set_model_state_dict(model, dict(ref_msd) if rank == 0 else {}, options=options)
        set_optimizer_state_dict(model, opt, copy.deepcopy(ref_osd) if rank == 0 else {},
                                 options=options)
        continued[name] = scripts.train(model, opt, 2, rank, world_size, first_step=2)
    for (loss, norm), (ref_loss, ref_norm) in zip(continued["fsdp_ext"], continued["torch"]):
        torch.testing.assert_close(loss, ref_loss, **FP32)
        torch.testing.assert_close(norm, ref_norm, **FP32)

    # get/set_state_dict together, sharded, and strict=False with a key left out.
    _, model, opt = trained["fsdp_ext"]
    msd, osd = get_state_dict(model, opt)
    fresh = scripts.shard(scripts.ours(), scripts.build(seed=2), mesh=mesh)
    fresh_opt = scripts.adamw(fresh)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    for (n, p), q in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), n
    partial = {k: v for k, v in get_model_state_dict(model).items() if k != "ln_f.bias"}
    other = scripts.shard(scripts.ours(), scripts.build(seed=3), mesh=mesh)
    before = other.ln_f.bias.full_tensor()
    result = set_model_state_dict(other, partial, options=StateDictOptions(strict=False))
    assert "ln_f.bias" in result.missing_keys, result
    assert torch.equal(other.ln_f.bias.full_tensor(), before)
    torch.testing.assert_close(other.ln_f.weight.full_tensor(), model.ln_f.weight.full_tensor())
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_torch_state_dict_helpers(world_size):
    run_distributed(state_dict_helpers_worker, world_size)


# ---- DCP checkpoints, both ways, across world sizes ---------------------------------------------------
def _checkpoint(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _restore(model, opt, path: str) -> None:
    """torchtitan's flow: the state-dict helpers, dcp.load into them, then set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    state = _checkpoint(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def dcp_worker(rank: int, world_size: int, directory: str, phase: str) -> None:
    """save: at world 2, torch FSDP2 trains 2 steps and saves, then trains 2 more (the losses a
    resumed run must reproduce). cross: at world 3, fsdp_ext resumes from torch's checkpoint and
    must continue with those losses; then trains from scratch itself and saves. back: at world
    2, torch FSDP2 resumes from fsdp_ext's world-3 checkpoint, again with those losses."""
    import torch.distributed.checkpoint as dcp
    mesh = init_device_mesh("cpu", (world_size,))
    expected_path = f"{directory}/expected.pt"
    if phase == "save":
        model = scripts.shard(scripts.torch_fsdp(), scripts.build(), mesh=mesh)
        opt = scripts.adamw(model)
        scripts.train(model, opt, 2, rank, world_size)
        dcp.save(_checkpoint(model, opt), checkpoint_id=f"{directory}/torch_w2")
        expected = scripts.train(model, opt, 2, rank, world_size, first_step=2)
        if rank == 0:
            torch.save(expected, expected_path)
        dist.barrier()
        return
    expected = torch.load(expected_path)
    if phase == "cross":
        model = scripts.shard(scripts.ours(), scripts.build(seed=5), mesh=mesh)
        opt = scripts.adamw(model)
        _restore(model, opt, f"{directory}/torch_w2")
        resumed = scripts.train(model, opt, 2, rank, world_size, first_step=2)
        model = scripts.shard(scripts.ours(), scripts.build(), mesh=mesh)
        opt = scripts.adamw(model)
        scripts.train(model, opt, 2, rank, world_size)
        dcp.save(_checkpoint(model, opt), checkpoint_id=f"{directory}/fsdp_ext_w3")
    else:
        model = scripts.shard(scripts.torch_fsdp(), scripts.build(seed=5), mesh=mesh)
        opt = scripts.adamw(model)
        _restore(model, opt, f"{directory}/fsdp_ext_w3")
        resumed = scripts.train(model, opt, 2, rank, world_size, first_step=2)
    for (loss, norm), (ref_loss, ref_norm) in zip(resumed, expected):
        torch.testing.assert_close(loss, ref_loss, **FP32, msg=lambda m: f"{phase} loss: {m}")
        torch.testing.assert_close(norm, ref_norm, **FP32, msg=lambda m: f"{phase} norm: {m}")
    dist.barrier()


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp_interop"))


@pytest.mark.parametrize("phase,world_size", [("save", 2), ("cross", 3), ("back", 2)])
def test_dcp_checkpoints_interchange_with_torch_fsdp2(phase, world_size, dcp_dir):
    run_distributed(dcp_worker, world_size, dcp_dir, phase)


# ---- torchtitan's flows: equal shards through DCP, meta-device init ---------------------------------
def equal_shards_roundtrip(rank: int, world_size: int, directory: str) -> None:
    """Every parameter's dim 0 divides by the world size, so every rank's shards have the same
    shapes: a DCP round trip must still give each rank its own optimizer state back."""
    import torch.distributed.checkpoint as dcp
    from examples.models import GPTConfig
    cfg = GPTConfig(vocab_size=72, block_size=12, n_layer=2, n_head=2, d_model=24)  # 2, 3 divide
    mesh = init_device_mesh("cpu", (world_size,))
    model = scripts.shard(scripts.ours(), scripts.build(cfg=cfg), mesh=mesh)
    opt = scripts.adamw(model)
    scripts.train(model, opt, 2, rank, world_size)
    path = f"{directory}/equal_shards"
    dcp.save(_checkpoint(model, opt), checkpoint_id=path)
    fresh = scripts.shard(scripts.ours(), scripts.build(seed=7, cfg=cfg), mesh=mesh)
    fresh_opt = scripts.adamw(fresh, lr=0.5)
    _restore(fresh, fresh_opt, path)
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
        for key, value in opt.state[p].items():
            assert torch.equal(scripts.full(fresh_opt.state[q][key]).cpu(),
                               scripts.full(value).cpu()), key
            if isinstance(value, DTensor):
                assert torch.equal(fresh_opt.state[q][key].to_local(), value.to_local()), key


class TitanBlock(torch.nn.Module):
    """A block whose init reads .shape and calls nn.init on its (DTensor) parameters."""

    def __init__(self, dim: int):
        super().__init__()
        self.w1 = torch.nn.Linear(dim, 3 * dim)
        self.w2 = torch.nn.Linear(3 * dim, dim, bias=False)
        self.norm = torch.nn.LayerNorm(dim)

    def init_weights(self, std: float) -> None:
        torch.nn.init.trunc_normal_(self.w1.weight, std=std / self.w1.weight.shape[1] ** 0.5)
        torch.nn.init.zeros_(self.w1.bias)
        torch.nn.init.normal_(self.w2.weight, std=std)
        self.norm.reset_parameters()

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Titan(torch.nn.Module):
    def __init__(self, dim: int = 10, depth: int = 3):
        super().__init__()
        self.embed = torch.nn.Linear(7, dim)
        self.layers = torch.nn.ModuleList(TitanBlock(dim) for _ in range(depth))
        self.out = torch.nn.Linear(dim, 5)

    def init_weights(self) -> None:
        torch.nn.init.normal_(self.embed.weight)
        torch.nn.init.zeros_(self.embed.bias)
        for layer in self.layers:
            layer.init_weights(0.02)
        self.out.reset_parameters()

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def meta_init(rank: int, world_size: int) -> None:
    """Built on meta, sharded, to_empty, then the model's own init on the DTensor parameters:
    the same values as torch FSDP2 on the same script and seed; then training matches too."""
    mesh = init_device_mesh("cpu", (world_size,))
    runs = {}
    for fsdp in (scripts.torch_fsdp(), scripts.ours()):
        with torch.device("meta"):
            model = Titan()
        for layer in model.layers:
            fsdp.fully_shard(layer, mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(11)
        model.init_weights()
        runs[fsdp.name] = model
    for (name, p), q in zip(runs["fsdp_ext"].named_parameters(), runs["torch"].parameters()):
        assert isinstance(p, DTensor) and not p.is_meta, name
        assert torch.equal(p.to_local(), q.to_local()), name
    losses = {}
    for name, model in runs.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[name] = loss.detach()
    torch.testing.assert_close(losses["fsdp_ext"], losses["torch"], **FP32)


def flows_worker(rank: int, world_size: int, directory: str) -> None:
    equal_shards_roundtrip(rank, world_size, directory)
    meta_init(rank, world_size)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_torchtitan_flows(world_size, tmp_path):
    run_distributed(flows_worker, world_size, str(tmp_path))


# ---- a Hugging Face model through the whole loop ------------------------------------------------------
def hf_llama_loop(rank: int, world_size: int, directory: str) -> None:
    """transformers' Llama (random weights, small config): fully_shard per decoder layer and the
    root, AdamW, torch's clip_grad_norm_, get_state_dict + DCP save, a fresh model resumed with
    dcp.load + set_state_dict, more steps: losses and norms equal torch FSDP2's on the script."""
    import torch.distributed.checkpoint as dcp
    from ..clients.test_transformers import VOCAB, SEQ, build
    mesh = init_device_mesh("cpu", (world_size,))
    traces = {}
    for fsdp in (scripts.torch_fsdp(), scripts.ours()):
        def sharded():
            model, layer_cls = build("llama")
            for layer in model.model.layers:
                fsdp.fully_shard(layer, mesh=mesh)
            return fsdp.fully_shard(model, mesh=mesh)

        def steps(model, opt, first):
            out = []
            for step in range(first, first + 2):
                ids = torch.randint(3, VOCAB, (2 * world_size, SEQ),
                                    generator=torch.Generator().manual_seed(step))[
                    rank * 2:(rank + 1) * 2]
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                norm = scripts.full(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
                opt.step()
                opt.zero_grad()
                out.append((float(loss), float(norm)))
            return out

        model = sharded()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
        trace = steps(model, opt, 0)
        path = f"{directory}/llama_{fsdp.name}"
        dcp.save(_checkpoint(model, opt), checkpoint_id=path)
        resumed = sharded()
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3, eps=1e-6)
        _restore(resumed, resumed_opt, path)
        traces[fsdp.name] = trace + steps(resumed, resumed_opt, 2)
    for (loss, norm), (ref_loss, ref_norm) in zip(traces["fsdp_ext"], traces["torch"]):
        torch.testing.assert_close(loss, ref_loss, **FP32)
        torch.testing.assert_close(norm, ref_norm, **FP32)
    dist.barrier()


@pytest.mark.slow
@pytest.mark.essential
def test_hugging_face_llama_loop(tmp_path):
    pytest.importorskip("transformers")
    run_distributed(hf_llama_loop, 2, str(tmp_path))


# ---- FSDP x tensor parallelism on a 2-D mesh ------------------------------------------------------------
class TPBlock(torch.nn.Module):
    def __init__(self, dim: int = 12, hidden: int = 20):
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden)
        self.w2 = torch.nn.Linear(hidden, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class TPNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(7, 12)
        self.blocks = torch.nn.ModuleList(TPBlock() for _ in range(2))
        self.out = torch.nn.Linear(12, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _tp_model(fsdp, mesh) -> TPNet:
    """parallelize_module on the "tp" dimension, then fully_shard on the "dp" one."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    model = TPNet()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=mesh["dp"])
    return fsdp.fully_shard(model, mesh=mesh["dp"])


def _tp_train(model, opt, mesh, steps: int, first: int = 0):
    dp = mesh["dp"].get_local_rank()
    out = []
    for step in range(first, first + steps):
        x = torch.randn(8, 7, generator=torch.Generator().manual_seed(step))[dp * 4:(dp + 1) * 4]
        loss = model(x).square().mean()
        loss.backward()
        # torch's clip_grad_norm_ cannot mix the dp and (dp, tp) meshes: the norm by hand
        norm = sum(p.grad.full_tensor().square().sum() for p in model.parameters()) ** 0.5
        opt.step()
        opt.zero_grad()
        out.append((float(loss.detach()), float(norm)))
    return out


def tensor_parallel_worker(rank: int, world_size: int, directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    runs = {}
    for fsdp in (scripts.torch_fsdp(), scripts.ours()):
        model = _tp_model(fsdp, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        runs[fsdp.name] = (model, opt, _tp_train(model, opt, mesh, 2))
    ours, theirs = runs["fsdp_ext"][0], runs["torch"][0]
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.placements == q.placements and p.device_mesh.ndim == q.device_mesh.ndim, name
        assert p.to_local().shape == q.to_local().shape, name
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), **FP32)
    for (loss, norm), (ref_loss, ref_norm) in zip(runs["fsdp_ext"][2], runs["torch"][2]):
        torch.testing.assert_close(loss, ref_loss, **FP32)
        torch.testing.assert_close(norm, ref_norm, **FP32)
    # fsdp_ext's own clip and full state dict know the TP mesh too.
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(9))
    ours(x).square().mean().backward()
    expected = float(sum(p.grad.full_tensor().square().sum() for p in ours.parameters()) ** 0.5)
    torch.testing.assert_close(float(ours.clip_grad_norm_(1e9)), expected, **FP32)
    runs["fsdp_ext"][1].zero_grad()
    full = fsdp_ext.full_state_dict(ours)
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(full[name], p.full_tensor(), **FP32)
    # DCP: fsdp_ext's FSDP x TP checkpoint resumes torch's FSDP x TP with the same losses, and
    # loads into a plain 1-D fully_shard model over all four ranks.
    path = f"{directory}/tp"
    dcp.save(_checkpoint(ours, runs["fsdp_ext"][1]), checkpoint_id=path)
    expected = _tp_train(ours, runs["fsdp_ext"][1], mesh, 2, first=2)
    model = _tp_model(scripts.torch_fsdp(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _restore(model, opt, path)
    for (loss, norm), (ref_loss, ref_norm) in zip(_tp_train(model, opt, mesh, 2, first=2), expected):
        torch.testing.assert_close(loss, ref_loss, **FP32)
        torch.testing.assert_close(norm, ref_norm, **FP32)
    torch.manual_seed(1)
    plain = scripts.ours().fully_shard(TPNet(), mesh=init_device_mesh("cpu", (world_size,)))
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=path)
    plain.load_state_dict(state["model"])
    for name, value in full.items():
        torch.testing.assert_close(plain.get_parameter(name).full_tensor(), value, **FP32)
    dist.barrier()


def test_fsdp_with_tensor_parallel(tmp_path):
    run_distributed(tensor_parallel_worker, 4, str(tmp_path))
