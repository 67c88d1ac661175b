"""The planner: its communication model by hand, its layout against the runtime's buckets, and its
memory estimate against fsdp_ext.diagnostics.memory's accounting of a real 2-rank run."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_ext
from fsdp_ext.planner.comm_model import H100, Link, all_gather_s, all_reduce_s, fit_link, reduce_scatter_s
from fsdp_ext.runtime.bucket.layout import ALIGN
from fsdp_ext.diagnostics.memory import memory_report
from examples.models import Block, GPT, GPTConfig
from fsdp_ext.planner.plan import project
from fsdp_ext.planner.measure import UnitSpec
from fsdp_ext.planner.model import padded_numel

from ..helpers.dist import run_distributed

LINK = Link("test", alpha_s=1e-3, bandwidth=1e9)


def test_ring_costs_by_hand():
    # 4 ranks, 8 MB: 3 steps of latency plus 3/4 of the bytes at 1 GB/s.
    assert all_gather_s(8e6, 4, LINK) == pytest.approx(3e-3 + 0.75 * 8e6 / 1e9)
    assert reduce_scatter_s(8e6, 4, LINK) == all_gather_s(8e6, 4, LINK)
    assert all_reduce_s(8e6, 4, LINK) == pytest.approx(2 * all_gather_s(8e6, 4, LINK))
    assert all_gather_s(8e6, 1, LINK) == 0.0
    # Latency only for empty messages; the bandwidth term is linear in bytes.
    assert all_gather_s(0, 8, LINK) == pytest.approx(7e-3)
    extra = all_gather_s(2e6, 2, LINK) - all_gather_s(1e6, 2, LINK)
    assert extra == pytest.approx(0.5 * 1e6 / 1e9)


def test_fit_link_recovers_alpha_and_bandwidth():
    samples = [(b, all_gather_s(b, 2, LINK)) for b in (1e4, 1e6, 1e8)]
    fitted = fit_link(samples, 2, "fit")
    assert fitted.alpha_s == pytest.approx(LINK.alpha_s, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(LINK.bandwidth, rel=1e-6)


def test_cluster_link_crosses_nodes():
    assert H100.link_for(8) is H100.intra and H100.link_for(16) is H100.inter
    assert all_gather_s(1e9, 16, H100.link_for(16)) > all_gather_s(1e9, 8, H100.link_for(8))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_padded_numel_is_what_each_rank_sends(world_size):
    """fully_shard cuts each parameter into world_size chunks of ceil(rows / world_size) rows
    (torch.chunk) and every rank sends its chunk of each, ALIGN-aligned; FullyShardedDataParallel
    sends equal slices of the aligned parameters laid end to end."""
    gen = torch.Generator().manual_seed(world_size)
    shapes = [tuple(int(d) for d in torch.randint(1, 40, (int(k),), generator=gen))
              for k in torch.randint(1, 3, (7,), generator=gen)]
    chunks = sum(world_size * math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in shapes)
    rows = padded_numel(UnitSpec("u", None, shapes), world_size)
    assert chunks <= rows <= chunks + world_size * ALIGN * len(shapes)
    assert rows % world_size == 0
    flat = padded_numel(UnitSpec("u", None, shapes, layout="flat"), world_size)
    total = sum(math.prod(s) for s in shapes)
    assert total <= flat <= total + ALIGN * len(shapes) + world_size and flat % world_size == 0


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32))


def check_memory_estimate(rank: int, world_size: int) -> None:
    reference = _model()
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(rank))
    budget = 2**40
    p = fsdp_ext.plan(reference, world_size, unit_classes={Block}, compute_s=1.0,
                      loss_fn=lambda m: m(idx, idx), memory_budget=budget, prefetch=(1,))
    estimate = p.estimate("FULL_SHARD", 1)
    assert p.best() is not None and all(e.fits for e in p.estimates)

    model = copy.deepcopy(reference)
    for block in model.blocks:
        fsdp_ext.fully_shard(block)
    fsdp_ext.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):  # the second step knows the order (last block kept for backward)
        opt.zero_grad(set_to_none=True)
        loss = model(idx, idx)
        gathered_after_forward = memory_report(model)["unsharded"]
        loss.backward()
        opt.step()
    measured = memory_report(model, opt)
    sums = {k: torch.tensor([measured[k]], dtype=torch.float64) for k in ("params", "optimizer")}
    for t in sums.values():
        dist.all_reduce(t)
    # Sharded state: the planner's per-rank figure is the average over ranks of the real shards.
    assert estimate.memory["params"] == pytest.approx(sums["params"].item() / world_size, rel=1e-9)
    assert estimate.memory["grads"] == estimate.memory["params"]
    assert estimate.memory["optimizer"] == pytest.approx(sums["optimizer"].item() / world_size,
                                                         rel=0.01)
    # Gathered at the end of forward: the root and the last block; the planner adds the unit the
    # backward prefetch brings in next (depth 1), so it exceeds the measurement by one block.
    block_bytes = max(padded_numel(u, world_size) * 4 for u in p.model.units if not u.is_root)
    assert gathered_after_forward < estimate.memory["gathered"]
    assert estimate.memory["gathered"] - gathered_after_forward <= block_bytes
    # Activations: what autograd saves, measured here by an independent hook on the same forward.
    seen = {}
    params = {q.untyped_storage().data_ptr() for q in reference.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        reference(idx, idx)
    assert estimate.memory["activations"] == sum(seen.values())


def test_memory_estimate_against_two_rank_accounting():
    run_distributed(check_memory_estimate, 2)


def test_budget_selects_fitting_settings():
    model = _model()
    idx = torch.randint(0, 64, (4, 16))
    p = fsdp_ext.plan(model, 4, unit_classes={Block}, compute_s=0.1, link=LINK,
                      loss_fn=lambda m: m(idx, idx))
    by = {(e.setting.strategy, e.setting.prefetch): e for e in p.estimates}
    # Replicating holds the whole model, sharding a quarter; gathering more units costs more.
    assert by[("NO_SHARD", 1)].memory["peak"] > by[("FULL_SHARD", 1)].memory["peak"]
    assert by[("FULL_SHARD", 2)].memory["peak"] > by[("FULL_SHARD", 0)].memory["peak"]
    budget = (by[("NO_SHARD", 1)].memory["peak"] + by[("FULL_SHARD", 1)].memory["peak"]) / 2
    p = fsdp_ext.plan(model, 4, unit_classes={Block}, compute_s=0.1, link=LINK,
                      loss_fn=lambda m: m(idx, idx), memory_budget=budget)
    assert not p.estimate("NO_SHARD", 1).fits and p.estimate("FULL_SHARD", 1).fits
    assert p.best().fits and "best" in str(p)


def test_projection_on_meta_device():
    with torch.device("meta"):
        model = nn.Sequential(*(nn.TransformerEncoderLayer(1024, 16, 4096) for _ in range(4)))
    plans = project(model, [8, 64], H100, unit_classes={nn.TransformerEncoderLayer},
                    flops_per_step=1e15, activation_bytes=2**30)
    small, large = plans[8].estimate("FULL_SHARD", 1), plans[64].estimate("FULL_SHARD", 1)
    assert large.memory["params"] < small.memory["params"]          # more shards
    assert large.time["comm"] > small.time["comm"]                  # crosses the slower link
    assert small.time["compute"] == pytest.approx(1e15 / (H100.peak_flops * H100.mfu))
    hybrid = plans[64].estimate("HYBRID_SHARD", 1)
    assert hybrid.memory["params"] == pytest.approx(small.memory["params"], rel=0.01)


def test_exposed_communication_where_cpu_ranks_fill_the_cores():
    """Saturated CPU ranks: the first all-gather and the last reduction in full, the rest scaled by
    the measured contention (0: hidden, 1: serial); depth 0 exposes everything."""
    from fsdp_ext.planner.model import PlanInputs, Setting, estimate_time
    specs = [UnitSpec("", None, [(1000,)], is_root=True)] + [
        UnitSpec(f"b{i}", None, [(4000,)]) for i in range(3)]
    inputs = PlanInputs(units=specs, world_size=2, compute_s=1.0, adamw_s_per_element=0.0,
                        link=LINK, comm_hides=False)
    times = {}
    for contention in (0.0, 0.5, 1.0):
        inputs.contention = contention
        times[contention] = estimate_time(inputs, Setting("FULL_SHARD", 1))
    comm = times[1.0]["comm"]
    unhidable = times[0.0]["exposed_comm"]
    assert 0 < unhidable < comm
    assert times[1.0]["exposed_comm"] == pytest.approx(comm)
    assert times[0.5]["exposed_comm"] == pytest.approx(unhidable + 0.5 * (comm - unhidable))
    assert estimate_time(inputs, Setting("FULL_SHARD", 0))["exposed_comm"] == pytest.approx(comm)


def check_contention_measured(rank: int, world_size: int) -> None:
    model = _model()
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(rank))
    p = fsdp_ext.plan(model, world_size, unit_classes={Block}, loss_fn=lambda m: m(idx, idx),
                      threads_per_rank=64, prefetch=(1,), strategies=("FULL_SHARD",))
    assert p.model.contention >= 0.0
    assert any("still adds to the step (measured)" in note for note in p.notes), p.notes


def test_contention_measured_inside_a_process_group():
    # threads_per_rank=64: the ranks count as filling every core on any machine.
    run_distributed(check_contention_measured, 2)
