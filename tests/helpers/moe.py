"""The MoE example (examples/moe.py) trained through torchtitan 0.3.0's `apply_fsdp_to_decoder`,
with any `fully_shard` implementation, beside the same training of the unwrapped model in one
process (the reference).

    sharded = train_sharded("torch", world_size=4)      # or "fsdp_ext": the one argument
    reference = train_reference(world_size=4)
    compare(sharded, reference)                          # None, or what differs

`train_sharded` launches `world_size` gloo ranks; each builds the model from the same seed, calls
`apply_fsdp_to_decoder(model, dp_mesh, ...)` (by default with EP=1: a 1-D `dp_mesh`, no expert
mesh) after pointing the `fully_shard` name that torchtitan's module calls at the chosen
implementation, and trains STEPS AdamW steps on its slice of each global batch. torchtitan sets
every FSDPModule's gradient divide factor to 1.0 (it scales the loss itself); each rank's loss is
therefore divided by the world size here, so the summed gradients are the mean over ranks, and
reductions are forced to plain sums (torch's FSDP2 would use PREMUL_SUM for a factor, which gloo
lacks). The reference takes the same steps on the whole batch, one rank's slice at a time, each
slice's loss divided by the world size, its gradients accumulated: the same sum the reduce-scatter
forms, in another order.

CFG's experts are chosen so that both placements occur: layer 1 has 4 experts, layer 2 has 3;
torchtitan shards the routed experts `Shard(1)` when the FSDP degree exceeds their number, so at
world 2 every parameter is `Shard(0)` (3 experts in chunks of 2 and 1), at world 4 layer 2's
experts are `Shard(1)` and layer 1's `Shard(0)`. Dims 1 divide by 4 (64, 96): torch's FSDP2 refuses
uneven sharding on any dim but 0 ("FSDP does not support uneven sharding on dim 1"); dims 0 need
not (vocabulary 67, block size 16: the embedding and lm_head in uneven chunks).

With `ep=2` (world 4) the model first gets expert parallelism (examples/moe_ep.py) over the `ep`
axis of a (efsdp, ep) = (2, 2) mesh built as torchtitan builds it (ep the fast axis: ep groups
{0, 1} and {2, 3}, efsdp groups {0, 2} and {1, 3}), and `apply_fsdp_to_decoder` gets
`ep_degree=2` and the `efsdp` mesh: the routed experts are sharded over efsdp, every other
parameter over the whole world (the 1-D `dp_shard` mesh). CFG_EP's blocks have 4 and 2 experts:
efsdp * ep = 4 ranks shard layer 1's experts Shard(0) and layer 2's Shard(1). The sum reductions
keep this right: an expert's gradient on its ep rank already sums the contributions of the ep
group's tokens (they came to it by all-to-all), and the reduce-scatter over efsdp adds the other
group's.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from examples.moe import MoEConfig, MoEDecoder
from examples.moe_ep import apply_expert_parallel

from .dist import run_distributed

CFG = MoEConfig(vocab_size=67, block_size=16, dim=64, n_heads=4, layer_experts=(0, 4, 3),
                top_k=2, hidden_dim=96, dense_hidden_dim=128)
CFG_EP = dataclasses.replace(CFG, layer_experts=(0, 4, 2))
STEPS, GLOBAL_BATCH, SEED, LR = 4, 8, 0, 1e-2


def fully_shard_impl(impl: str):
    """The `fully_shard` to put into torchtitan's module: "torch" or "fsdp_ext"."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
        return fully_shard
    if impl == "fsdp_ext":
        import fsdp_ext
        return fsdp_ext.fully_shard
    raise ValueError(f"unknown fully_shard implementation {impl!r}: 'torch' or 'fsdp_ext'")


def batch(step: int, rank: int, world_size: int, cfg: MoEConfig = CFG):
    """Rank `rank`'s slice of step `step`'s global batch (the same global batch at any world):
    sequences from random starts, each token mostly (5 * previous + 3) mod vocab_size, a little
    noise, so that a few steps lower the loss."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, cfg.block_size + 1), generator=g)
    keep = torch.rand(tokens.shape, generator=g) < 0.1
    for t in range(1, tokens.shape[1]):
        follow = (5 * tokens[:, t - 1] + 3) % cfg.vocab_size
        tokens[:, t] = torch.where(keep[:, t], tokens[:, t], follow)
    per_rank = GLOBAL_BATCH // world_size
    mine = tokens[rank * per_rank:(rank + 1) * per_rank]
    return mine[:, :-1], mine[:, 1:]


def _optimizer(model, kind: str = "adamw"):
    """AdamW as torchtitan trains, or plain SGD ("sgd"), whose update is the gradient times the
    learning rate: round-off in a gradient stays round-off in the parameters (test_moe.py's EP
    comparison with the unwrapped model needs that; see there)."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR)
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def shard_with_torchtitan(model: MoEDecoder, impl: str, world_size: int,
                          ep: int = 1) -> MoEDecoder:
    """torchtitan's `apply_fsdp_to_decoder` with `impl`'s fully_shard, at expert-parallel degree
    `ep` (EP applied here first when > 1); sum reductions."""
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    dp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    edp_mesh = None
    if ep > 1:
        sparse = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("efsdp", "ep"))
        apply_expert_parallel(model, sparse["ep"])
        edp_mesh = sparse["efsdp"]
    original = tt_fsdp.fully_shard
    tt_fsdp.fully_shard = fully_shard_impl(impl)
    try:
        tt_fsdp.apply_fsdp_to_decoder(model, dp_mesh, param_dtype=torch.float32,
                                      reduce_dtype=torch.float32, pp_enabled=False,
                                      ep_degree=ep, edp_mesh=edp_mesh)
    finally:
        tt_fsdp.fully_shard = original
    for module in model.modules():
        if isinstance(module, tt_fsdp.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def _full(tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def _placement(param) -> str:
    """Its placements, one per mesh dim, plain shards as "Shard(d)" (e.g. "Shard(1), Shard(0)"
    for an expert weight under EP; "_StridedShard(dim=0, sf=2), Shard(0)" where FSDP and EP both
    split dim 0)."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return "not a DTensor"
    return ", ".join(f"Shard({p.dim})" if type(p) is Shard else repr(p) for p in placements)


def _worker(rank: int, world_size: int, impl: str, cfg: MoEConfig, steps: int, ep: int,
            optimizer_kind: str, out: str) -> None:
    model = shard_with_torchtitan(MoEDecoder(cfg, seed=SEED), impl, world_size, ep)
    placements = {name: _placement(p) for name, p in model.named_parameters()}
    units = sum(1 for m in model.modules() if isinstance(m, torch.distributed.fsdp.FSDPModule))
    optimizer = _optimizer(model, optimizer_kind)
    losses, grads = [], []
    for step in range(steps):
        x, y = batch(step, rank, world_size, cfg)
        loss = model(x, y) / world_size
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        grads.append({name: _full(p.grad) for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = {name: _full(p) for name, p in model.named_parameters()}
    if rank == 0:
        torch.save(dict(losses=losses, grads=grads, params=params, placements=placements,
                        units=units), out)


def train_sharded(impl: str, world_size: int, cfg: MoEConfig = CFG, steps: int = STEPS,
                  ep: int = 1, optimizer_kind: str = "adamw") -> dict:
    """`steps` AdamW (or `optimizer_kind` "sgd") steps of the model sharded by
    `apply_fsdp_to_decoder` with `impl`'s fully_shard ("torch" or "fsdp_ext") on `world_size` gloo
    ranks, at expert-parallel degree `ep`. Returns
    {"losses": [global loss per step], "grads": [{name: full gradient} per step], "params":
    {name: full trained parameter}, "placements": {name: "Shard(d)", ...}, "units": FSDPModules
    on rank 0}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        run_distributed(_worker, world_size, impl, cfg, steps, ep, optimizer_kind, out)
        return torch.load(out)


def train_reference(world_size: int, cfg: MoEConfig = CFG, steps: int = STEPS,
                    optimizer_kind: str = "adamw") -> dict:
    """The same training unwrapped, in this process: losses, grads and params as train_sharded's."""
    model = MoEDecoder(cfg, seed=SEED)
    optimizer = _optimizer(model, optimizer_kind)
    losses, grads = [], []
    for step in range(steps):
        total = 0.0
        for rank in range(world_size):
            x, y = batch(step, rank, world_size, cfg)
            loss = model(x, y) / world_size
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return dict(losses=losses, grads=grads,
                params={name: p.detach().clone() for name, p in model.named_parameters()})


def compare(got: dict, expected: dict, rtol: float = 1e-5, atol: float = 1e-6,
            param_atol: float = 1e-3 * LR * STEPS) -> str | None:
    """None when the losses and every step's gradients agree within fp32 round-off (`rtol`,
    `atol`) and the trained parameters within `param_atol` (a thousandth of the learning rate
    summed over the steps: AdamW divides each gradient by its own running RMS, so round-off in a
    gradient near zero moves that element's update by more than round-off, and the steps after
    carry it); else the first difference found."""
    if len(got["losses"]) != len(expected["losses"]):
        return f"{len(got['losses'])} steps, expected {len(expected['losses'])}"
    for step, (a, b) in enumerate(zip(got["losses"], expected["losses"])):
        if abs(a - b) > atol + rtol * abs(b):
            return f"step {step}: loss {a!r}, expected {b!r}"
    checks = [(f"step {s} grad", g, e, atol) for s, (g, e) in enumerate(zip(got["grads"],
                                                                            expected["grads"]))]
    for what, g, e, tol in checks + [("trained", got["params"], expected["params"], param_atol)]:
        if sorted(g) != sorted(e):
            return f"{what}: parameter names differ: {sorted(set(g) ^ set(e))}"
        for name in e:
            if g[name].shape != e[name].shape:
                return (f"{what} {name}: shape {tuple(g[name].shape)}, "
                        f"expected {tuple(e[name].shape)}")
            if not torch.allclose(g[name], e[name], rtol=rtol, atol=tol):
                diff = (g[name] - e[name]).abs().max().item()
                return f"{what} {name}: max abs difference {diff:.3g}"
    return None
