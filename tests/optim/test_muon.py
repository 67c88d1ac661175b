"""fsdp_ext.optim.Muon: torch.optim.Muon's math bit for bit on whole matrices (every
`adjust_lr_fn`, with and without Nesterov, expert stacks per expert), and on sharded parameters:
fsdp_ext's fully_shard and torch's on the same script give the same losses and parameters bit for
bit (each split matrix orthogonalised whole on one owner rank, each rank getting its part
back; under HSDP too), both within rounding of
single-process torch.optim.Muon; refusals name the parameter."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import fsdp_ext
from fsdp_ext.optim import Muon
from examples.models import GPT, GPTConfig

from ..helpers.dist import local_slice, run_distributed

EXACT = dict(atol=0, rtol=0)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 12, bias=False),
                         nn.Tanh(), nn.Linear(12, 4, bias=False))


def _train_whole(cls, steps: int = 4, **kwargs) -> list[torch.Tensor]:
    model = _mlp()
    opt = cls(model.parameters(), lr=0.02, **kwargs)
    for step in range(steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kwargs", [{}, dict(nesterov=False), dict(adjust_lr_fn="original"),
                                    dict(adjust_lr_fn="match_rms_adamw"),
                                    dict(adjust_lr_fn="spectral_unclamped", weight_decay=0.0),
                                    dict(ns_steps=3, ns_coefficients=(3.0, -3.2, 1.2))],
                         ids=["defaults", "no_nesterov", "original", "match_rms_adamw",
                              "spectral_unclamped", "other_ns"])
def test_whole_matrices_match_torch_muon(kwargs):
    ours, theirs = _train_whole(Muon, **kwargs), _train_whole(torch.optim.Muon, **kwargs)
    for mine, torchs in zip(ours, theirs):
        torch.testing.assert_close(mine, torchs, **EXACT)


def test_an_expert_stack_is_each_experts_matrix():
    """A [E, out, in] stack steps as E separate [out, in] matrices under torch.optim.Muon."""
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(3, 6, 4))
    experts = [nn.Parameter(stack.detach()[e].clone()) for e in range(3)]
    ours = Muon([stack], lr=0.05, adjust_lr_fn="match_rms_adamw")
    theirs = torch.optim.Muon(experts, lr=0.05, adjust_lr_fn="match_rms_adamw")
    for step in range(3):
        grad = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(step))
        stack.grad = grad.clone()
        for e, p in enumerate(experts):
            p.grad = grad[e].clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(stack.detach(), torch.stack([p.detach() for p in experts]),
                               **EXACT)


def test_blocks_of_rows_are_each_blocks_matrix():
    """block_rows=R: a [M * R, C] matrix steps as M separate [R, C] matrices under
    torch.optim.Muon (DistMuon's BlockShard(0, R): one attention head per block)."""
    torch.manual_seed(0)
    heads = nn.Parameter(torch.randn(12, 5))
    blocks = [nn.Parameter(heads.detach()[4 * b:4 * b + 4].clone()) for b in range(3)]
    ours = Muon([{"params": [heads], "block_rows": 4}], lr=0.05, adjust_lr_fn="match_rms_adamw")
    theirs = torch.optim.Muon(blocks, lr=0.05, adjust_lr_fn="match_rms_adamw")
    for step in range(3):
        grad = torch.randn(12, 5, generator=torch.Generator().manual_seed(step))
        heads.grad = grad.clone()
        for b, p in enumerate(blocks):
            p.grad = grad[4 * b:4 * b + 4].clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(heads.detach(), torch.cat([p.detach() for p in blocks]), **EXACT)


def _same_shape_layers() -> nn.Module:
    """Layers of repeated shapes (three [16, 16], two [24, 16] and their transposes' kin)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False),
                         nn.Linear(16, 24, bias=False), nn.Tanh(), nn.Linear(24, 16, bias=False),
                         nn.Linear(16, 16, bias=False), nn.Linear(16, 24, bias=False))


def test_batched_newton_schulz_is_torchs_iteration_per_matrix(monkeypatch):
    """batch_same_shape=True: the matrices of one shape iterated together give torch's per-matrix
    iteration to bf16 rounding (batched and single products may round the last bit apart), and
    the same bits however the batches are cut (BATCH_ELEMENTS), tall matrices included."""
    from fsdp_ext.optim import newton_schulz
    group = dict(ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7,
                 block_rows=None, batch_same_shape=True)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen) for shape in
               [(16, 32), (16, 32), (40, 8), (3, 16, 32), (40, 8), (0, 16, 32), (5, 7)]]
    batched = newton_schulz.orthogonalised(tensors, group)
    one_by_one = newton_schulz.orthogonalised(tensors, {**group, "batch_same_shape": False})
    for got, want, given in zip(batched, one_by_one, tensors):
        assert got.shape == given.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(newton_schulz, "BATCH_ELEMENTS", 16 * 32 * 2)  # two [16, 32] a batch
    for got, want in zip(newton_schulz.orthogonalised(tensors, group), batched):
        torch.testing.assert_close(got, want, **EXACT)
    with pytest.raises(ValueError, match="ns_steps must be below 100"):
        newton_schulz.orthogonalised(tensors, {**group, "ns_steps": 100})


def test_batched_muon_trains_as_torch_muon():
    """A model whose layers share shapes, stepped with batch_same_shape=True: torch.optim.Muon's
    parameters to bf16 rounding of the orthogonalised updates."""
    models = [_same_shape_layers() for _ in range(2)]
    ours = Muon(models[0].parameters(), lr=0.02, batch_same_shape=True)
    theirs = torch.optim.Muon(models[1].parameters(), lr=0.02)
    for step in range(3):
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(step))
        for model, opt in zip(models, (ours, theirs)):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for mine, torchs in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(mine, torchs, atol=1e-3, rtol=0)


def test_newton_schulz_needs_only_the_bf16_of_its_input():
    """What lets the owner exchange send bf16 pieces (to_owners.NS_DTYPE): torch's iteration
    casts its input to bf16 first and returns bf16, so an fp32 matrix and its bf16 cast give
    the same bits. Fails the day torch's iteration works in another precision."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    from fsdp_ext.optim.to_owners import NS_DTYPE
    args = ((3.4445, -4.775, 2.0315), 5, 1e-7)
    for shape in [(12, 20), (20, 12)]:
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        result = _zeropower_via_newtonschulz(whole, *args)
        assert result.dtype == NS_DTYPE
        torch.testing.assert_close(_zeropower_via_newtonschulz(whole.to(NS_DTYPE), *args),
                                   result, **EXACT)


def test_pieces_are_where_dtensor_places_them():
    """to_owners.piece_of (Python integers, no host read) against torch's own placement helper:
    every coordinate of 1-D and 2-D meshes, Shard on one or both axes (the same dim twice
    included), uneven and empty pieces."""
    import itertools
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from fsdp_ext.optim.to_owners import piece_of
    cases = [((5, 3), (4,), (Shard(0),)), ((7, 6), (3,), (Shard(1),)), ((2, 9), (4,), (Shard(0),)),
             ((13, 4), (2, 3), (Replicate(), Shard(0))), ((13, 4), (2, 3), (Shard(0), Shard(0))),
             ((6, 10), (2, 4), (Shard(0), Shard(1))), ((3, 5, 7), (2, 2), (Shard(0), Shard(2))),
             ((0, 4), (2,), (Shard(0),))]
    for shape, mesh_shape, placements in cases:
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            want = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate),
                                                          placements)
            assert piece_of(shape, mesh_shape, coordinate, placements) == want, \
                (shape, mesh_shape, placements, coordinate)


def test_state_dicts_interchange_with_torch_muon():
    """fsdp_ext's Muon holds in its state dict what torch.optim.Muon holds (block_rows and
    batch_same_shape live in group_options, not in the groups), so each loads the other's: the
    momenta and hyperparameters come from the state dict, the options stay as the optimizer was
    built, and training continues as torch's Muon would, bit for bit."""
    def run(steps, opt, model):
        for step in steps:
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    theirs = _mlp()
    torch_muon = torch.optim.Muon(theirs.parameters(), lr=0.02)
    run(range(2), torch_muon, theirs)
    ours = _mlp()
    ours.load_state_dict(theirs.state_dict())
    muon = Muon(ours.parameters(), lr=0.5)
    muon.load_state_dict(copy.deepcopy(torch_muon.state_dict()))  # (as from a file: no
    # tensor shared with torch's optimizer, whose steps would then move ours too)
    assert muon.param_groups[0]["lr"] == 0.02
    assert muon.state_dict()["param_groups"][0].keys() == \
        torch_muon.state_dict()["param_groups"][0].keys()
    run(range(2, 4), torch_muon, theirs)
    run(range(2, 4), muon, ours)
    for mine, torchs in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(mine, torchs, **EXACT)
    back = torch.optim.Muon(_mlp().parameters())
    back.load_state_dict(copy.deepcopy(muon.state_dict()))
    heads = nn.Parameter(torch.randn(12, 5))
    blocks = Muon([{"params": [heads], "block_rows": 4}], batch_same_shape=True)
    blocks.load_state_dict(torch.optim.Muon([heads]).state_dict())
    assert blocks.group_options == [{"block_rows": 4, "batch_same_shape": True}]
    assert copy.deepcopy(blocks).group_options == blocks.group_options  # (pickled alike)


def test_refusals_name_the_parameter():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"parameter '0\.bias' has shape \[4\].*AdamW"):
        Muon(list(model.named_parameters()))
    with pytest.raises(ValueError, match="Adjust learning rate function nope"):
        Muon(model[0].parameters(), adjust_lr_fn="nope")
    with pytest.raises(ValueError, match=r"parameter '0\.weight' has shape \[4, 4\], which "
                       r"block_rows=3 does not cut"):
        Muon([{"params": [("0.weight", model[0].weight)], "block_rows": 3}])
    with pytest.raises(ValueError, match="momentum should be >= 0"):
        Muon([model[0].weight], momentum=-1.0)


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, d_model=16))


def _optimizers(model, muon_cls):
    """Moonlight's split: the blocks' matrices to Muon, embeddings, norms and biases to AdamW."""
    matrices = [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and ".blocks." in
                f".{n}"]
    names = {n for n, _ in matrices}
    others = [p for n, p in model.named_parameters() if n not in names]
    return [muon_cls(matrices, lr=0.02, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(others, lr=1e-3)]


def _built(shard, muon_cls):
    """The GPT, its blocks then the root sharded by `shard` (None: left whole), and its two
    optimizers."""
    model = _gpt()
    if shard is not None:
        for block in model.blocks:
            shard(block)
        shard(model)
    return model, _optimizers(model, muon_cls)


def _steps(model, optimizers, rank: int, world: int, steps, sharded: bool = True,
           rows: int = 4) -> list:
    """`rows` sequences per global batch, split across the ranks when `sharded`."""
    losses = []
    for step in steps:
        idx = torch.randint(0, 64, (rows, 8), generator=torch.Generator().manual_seed(step))
        batch = local_slice(idx, rank, world) if sharded else idx
        loss = model(batch, batch)
        loss.backward()
        losses.append(loss.detach().clone())
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return losses


def _full_params(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _train_gpt(shard, muon_cls, rank: int, world: int, steps: int = 3):
    model, optimizers = _built(shard, muon_cls)
    if shard is not None:
        assert model.blocks[0].mlp[0].weight.placements[-1] == Shard(0)  # (split: exchanged)
    losses = _steps(model, optimizers, rank, world, range(steps), sharded=shard is not None)
    return losses, _full_params(model)


def check_sharded_against_torch_fsdp2_and_single_process(rank, world):
    ours = _train_gpt(fsdp_ext.fully_shard, Muon, rank, world)
    theirs = _train_gpt(torch_fully_shard, Muon, rank, world)
    for mine, torchs in zip(ours[0], theirs[0]):
        torch.testing.assert_close(mine, torchs, **EXACT)
    for name, value in theirs[1].items():
        torch.testing.assert_close(ours[1][name], value, **EXACT, msg=lambda m: f"{name}: {m}")
    # the unwrapped model with torch.optim.Muon on the whole batch: the gradients differ by the
    # reduction's rounding only, which Newton-Schulz (in bf16) may carry a few bf16 ulps further
    losses = [l for l in _train_gpt(None, torch.optim.Muon, rank, world)[0]]
    mean = [l.clone() for l in ours[0]]
    for l in mean:
        dist.all_reduce(l)
        l /= world
    torch.testing.assert_close(torch.stack(mean), torch.stack(losses), atol=1e-4, rtol=1e-4)


def dcp_into_torch_fsdp2(build, rank, world, directory, rows: int = 4) -> list:
    """`build(fully_shard)` -> (model, optimizers): fsdp_ext's pair after 2 steps saved with DCP
    (torch's get_state_dict) loads into torch's fully_shard pair, and both continue 2 more steps
    with the same losses and parameters, bit for bit. Returns torch's optimizers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, optimizers = build(fsdp_ext.fully_shard)
    _steps(model, optimizers, rank, world, range(2), rows=rows)
    saved = {f"opt{i}": get_state_dict(model, opt)[1] for i, opt in enumerate(optimizers)}
    saved["model"] = get_state_dict(model, [])[0]
    dcp.save(saved, checkpoint_id=directory)
    theirs, their_optimizers = build(torch_fully_shard)
    _steps(theirs, their_optimizers, rank, world, range(1), rows=rows)  # (the optimizer state)
    loaded = {f"opt{i}": get_state_dict(theirs, opt)[1] for i, opt in enumerate(their_optimizers)}
    loaded["model"] = get_state_dict(theirs, [])[0]
    dcp.load(loaded, checkpoint_id=directory)
    for i, opt in enumerate(their_optimizers):
        set_state_dict(theirs, opt, model_state_dict=loaded["model"],
                       optim_state_dict=loaded[f"opt{i}"])
    ours_after = _steps(model, optimizers, rank, world, range(2, 4), rows=rows)
    theirs_after = _steps(theirs, their_optimizers, rank, world, range(2, 4), rows=rows)
    torch.testing.assert_close(torch.stack(ours_after), torch.stack(theirs_after), **EXACT)
    for name, value in _full_params(theirs).items():
        torch.testing.assert_close(_full_params(model)[name], value, **EXACT)
    return their_optimizers


def check_checkpoint_into_torch_fsdp2(rank, world, directory):
    """Muon's momentum is a DTensor placed as its parameter: fsdp_ext's model and optimizers saved
    with DCP load into torch's fully_shard ones and continue bit for bit."""
    their_optimizers = dcp_into_torch_fsdp2(lambda shard: _built(shard, Muon), rank, world,
                                            directory)
    momentum = next(iter(their_optimizers[0].state.values()))["momentum_buffer"]
    assert isinstance(momentum, DTensor), type(momentum)


def _momenta(model, optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: st["momentum_buffer"].full_tensor().clone()
            for p, st in optimizer.state.items()}


def _dcp_pair(model, optimizers) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    pair = {f"opt{i}": get_state_dict(model, opt)[1] for i, opt in enumerate(optimizers)}
    pair["model"] = get_state_dict(model, [])[0]
    return pair


def save_at_world_2(rank, world, directory):
    import torch.distributed.checkpoint as dcp
    model, optimizers = _built(fsdp_ext.fully_shard, Muon)
    _steps(model, optimizers, rank, world, range(2))
    dcp.save(_dcp_pair(model, optimizers), checkpoint_id=directory)
    full = {"params": _full_params(model), "momenta": _momenta(model, optimizers[0])}
    if rank == 0:
        torch.save(full, f"{directory}.full.pt")


def load_at_world_4(rank, world, directory):
    """The world-2 checkpoint loaded into fsdp_ext's and torch's fully_shard at world 4: the
    parameters and Muon's momenta hold the saved values, resharded, and both continue alike."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    saved = torch.load(f"{directory}.full.pt")
    pairs = []
    for shard in (fsdp_ext.fully_shard, torch_fully_shard):
        model, optimizers = _built(shard, Muon)
        _steps(model, optimizers, rank, world, range(1))  # (the optimizer state to load into)
        loaded = _dcp_pair(model, optimizers)
        dcp.load(loaded, checkpoint_id=directory)
        for i, opt in enumerate(optimizers):
            set_state_dict(model, opt, model_state_dict=loaded["model"],
                           optim_state_dict=loaded[f"opt{i}"])
        for group, values in (("params", _full_params(model)),
                              ("momenta", _momenta(model, optimizers[0]))):
            assert values.keys() == saved[group].keys(), group
            for name, value in values.items():
                torch.testing.assert_close(value, saved[group][name], **EXACT,
                                           msg=lambda m: f"{group} {name}: {m}")
        pairs.append((model, _steps(model, optimizers, rank, world, range(2, 4))))
    (ours, our_losses), (theirs, their_losses) = pairs
    torch.testing.assert_close(torch.stack(our_losses), torch.stack(their_losses), **EXACT)
    for name, value in _full_params(theirs).items():
        torch.testing.assert_close(_full_params(ours)[name], value, **EXACT)


@pytest.mark.slow
def test_muon_state_saved_at_world_2_loads_at_world_4(tmp_path):
    directory = str(tmp_path / "dcp")
    run_distributed(save_at_world_2, 2, directory, timeout_s=180)
    run_distributed(load_at_world_4, 4, directory, timeout_s=180)


class _Experts(nn.Module):
    """A routed-experts stack [E, out, in] (as torchtitan's GroupedExperts holds w1/w2/w3)."""

    def __init__(self, experts: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(experts, 6, 4) / 4)

    def forward(self, x):
        return torch.einsum("bi,eoi->beo", x, self.w).tanh().sum()


def check_whole_experts_step_without_a_collective(rank, world):
    """fully_shard's Shard(0) keeps whole experts per rank (3 experts over 2 ranks: 2 and 1):
    each rank's experts step from its own shard, no collective in the optimizer step, bit for bit
    as single-process torch.optim.Muon on each expert (the same batch on every rank: the averaged
    gradient is exactly the single process's). A split 2-D matrix goes to its owner and back."""
    from torch.distributed.tensor.debug import CommDebugMode
    model, whole = fsdp_ext.fully_shard(_Experts()), _Experts()
    experts = [nn.Parameter(whole.w.detach()[e].clone()) for e in range(3)]
    ours = Muon(model.parameters(), lr=0.05)
    theirs = torch.optim.Muon(experts, lr=0.05)
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        with torch.no_grad():  # the reference stack holds what torch's Muon stepped
            whole.w.copy_(torch.stack([p.detach() for p in experts]))
        model(x).backward()
        whole(x).backward()
        for e, p in enumerate(experts):
            p.grad = whole.w.grad[e].clone()
        whole.w.grad = None
        with CommDebugMode() as comm:
            ours.step()
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        theirs.step()
        ours.zero_grad()
    torch.testing.assert_close(model.w.full_tensor(), torch.stack([p.detach() for p in experts]),
                               **EXACT)
    matrix = fsdp_ext.fully_shard(nn.Linear(4, 6, bias=False))
    opt = Muon(matrix.parameters())
    matrix(torch.ones(2, 4)).sum().backward()
    with CommDebugMode() as comm:
        opt.step()
    # to its owner and back: two all-to-alls
    assert comm.get_comm_counts() == {torch.ops.c10d.alltoall_base_: 2}, comm.get_comm_counts()
    # the same [8, 4] matrix as two [4, 4] blocks: each rank's 4 rows are a whole block (no
    # collective); as four [2, 4] blocks too; as [8, 4] blocks of 8 rows it is split again
    for rows, collectives in ((4, 0), (2, 0), (8, 2)):
        matrix = fsdp_ext.fully_shard(nn.Linear(4, 8, bias=False))
        opt = Muon([{"params": matrix.parameters(), "block_rows": rows}])
        matrix(torch.ones(2, 4)).sum().backward()
        with CommDebugMode() as comm:
            opt.step()
        assert comm.get_total_counts() == collectives, (rows, comm.get_comm_counts())


def check_bad_placement(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    weight = nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Partial()]))
    with pytest.raises(NotImplementedError, match=r"parameter 'w' is a DTensor placed "
                       r"\(Partial\(sum\),\)"):
        Muon([("w", weight)])


def _worker(rank, world, directory):
    check_sharded_against_torch_fsdp2_and_single_process(rank, world)
    check_checkpoint_into_torch_fsdp2(rank, world, directory)
    check_whole_experts_step_without_a_collective(rank, world)
    check_bad_placement(rank, world)


def test_sharded_muon_at_world_2(tmp_path):
    run_distributed(_worker, 2, str(tmp_path / "dcp"), timeout_s=180)


def _hsdp_worker(rank, world):
    """World 4 as 2 replicas x 2 shards: the replicas exchange alike along their shard axis."""
    from functools import partial

    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ours = _train_gpt(partial(fsdp_ext.fully_shard, mesh=mesh), Muon, rank, world)
    theirs = _train_gpt(partial(torch_fully_shard, mesh=mesh), Muon, rank, world)
    torch.testing.assert_close(torch.stack(ours[0]), torch.stack(theirs[0]), **EXACT)
    for name, value in theirs[1].items():
        torch.testing.assert_close(ours[1][name], value, **EXACT, msg=lambda m: f"{name}: {m}")
    check_sharded_against_torch_fsdp2_and_single_process(rank, world)


def _tp_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 12, bias=False),
                         nn.Tanh(), nn.Linear(12, 8, bias=False))


def check_fsdp_x_tp_is_torch_muon_on_the_gathered_gradients(rank, world):
    """FSDP x TP (2 x 2): matrices split along two mesh axes, FSDP's _StridedShard over TP's
    rows (column-wise layers) and Shard(0) x Shard(1) (the row-wise one). Each step equals
    torch.optim.Muon run on whole copies of the parameters fed the gathered gradients, bit for
    bit, under fsdp_ext's fully_shard and torch's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from torch.distributed.tensor.placement_types import _StridedShard
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for shard in (fsdp_ext.fully_shard, torch_fully_shard):
        model = _tp_mlp()
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                               "4": ColwiseParallel(output_layouts=Replicate())})
        shard(model, mesh=mesh["dp"])
        assert type(model[0].weight.placements[0]) is _StridedShard
        assert model[2].weight.placements == (Shard(0), Shard(1))
        ours = Muon(model.parameters(), lr=0.02, adjust_lr_fn="match_rms_adamw")
        whole = [nn.Parameter(p.full_tensor()) for p in model.parameters()]
        theirs = torch.optim.Muon(whole, lr=0.02, adjust_lr_fn="match_rms_adamw")
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank // 2))
            model(x).square().sum().backward()
            for param, copy in zip(model.parameters(), whole):
                copy.grad = param.grad.full_tensor()
            ours.step()
            theirs.step()
            ours.zero_grad()
            for param, copy in zip(model.parameters(), whole):
                torch.testing.assert_close(param.full_tensor(), copy.detach(), **EXACT,
                                           msg=lambda m: f"{shard.__module__} step {step}: {m}")


@pytest.mark.slow
def test_sharded_muon_at_world_4_and_under_hsdp():
    run_distributed(_hsdp_worker, 4, timeout_s=240)


def test_sharded_muon_under_fsdp_x_tp():
    run_distributed(check_fsdp_x_tp_is_torch_muon_on_the_gathered_gradients, 4, timeout_s=180)
