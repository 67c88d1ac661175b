"""`fsdp_ext.plan`: before a launch, per-rank peak memory and step time of the fsdp_ext settings
(strategy x prefetch depth) for a model, and which of them fit a memory budget.

    import fsdp_ext
    p = fsdp_ext.plan(model, world_size=4, unit_classes={Block},
                      loss_fn=lambda m: F.mse_loss(m(x), y), memory_budget=8 * 2**30)
    print(p)          # one row per setting; the fastest one that fits is marked
    p.best()          # that estimate: .memory (bytes by component), .time (seconds by component)

The model is the one you are about to shard (unwrapped, or already wrapped: its units are used).
What the numbers mean and how they are computed: model.py. Projections to GPU clusters,
where nothing is measured: `project`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import measure
from .comm_model import Cluster, Link
from .model import (STRATEGIES, Plan, PlanInputs, Setting, build_plan, cpu_saturated,
                         estimate_time, padded_numel)

# Used when no process group is up to measure gloo: two ranks on one host over loopback, fitted by
# measure.measure_link on the idle 2-core development machine (three fits: 210-320 us,
# 1.34-2.04 GB/s; the lower bandwidth is kept).
GLOO_LOOPBACK = Link("gloo loopback (default; pass link= or plan inside a process group)",
                     alpha_s=250e-6, bandwidth=1.35e9)


def plan(model: nn.Module, world_size: int, *, unit_classes=None, loss_fn=None,
         activation_bytes: int | None = None, compute_s: float | None = None,
         flops_per_step: float | None = None, flop_rate: float | None = None,
         param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
         memory_budget: float | None = None, link: Link | None = None,
         cross_link: Link | None = None, ranks_per_node: int | None = None,
         threads_per_rank: int | None = None, device_type: str = "cpu",
         adamw_s_per_element: float | None = None, prefetch=(0, 1, 2),
         strategies=STRATEGIES, comm_policy=None, quant_s_per_byte: float = 0.0) -> Plan:
    """Estimate every (strategy, prefetch depth) for `model` sharded over `world_size` ranks.

    Args:
        model: the model (unwrapped, or wrapped with fully_shard: then its units are used).
        world_size: data-parallel ranks.
        unit_classes: module classes that become units (one per outermost instance); the rest of the
            parameters form the root unit. Ignored for an already wrapped model.
        loss_fn: `loss_fn(model) -> scalar loss` on one rank's batch; measures activations (saved
            tensors of one forward) and, unless compute_s or flops are given, the forward +
            backward time.
        activation_bytes: activations per rank, instead of measuring them.
        compute_s / flops_per_step + flop_rate: forward + backward seconds per step, given.
        param_dtype / reduce_dtype: as in MixedPrecisionPolicy (None: the parameters' dtype).
        memory_budget: bytes per rank; marks which settings fit.
        link: the shard group's alpha-beta link. Default: measured if a process group is up and this
            rank is in it (every rank must call plan then), else GLOO_LOOPBACK.
        cross_link / ranks_per_node: HYBRID_SHARD's shard group is one node's ranks; replicas use
            cross_link.
        threads_per_rank: torch threads per rank (CPU); with ranks_per_node it decides whether
            communication can hide behind compute (not when ranks' threads fill every core).
        device_type: "cpu" (gloo) or "cuda" (NCCL).
        adamw_s_per_element: optimizer seconds per parameter element (default: measured here).
        comm_policy / quant_s_per_byte: a CommPolicy's bytes on the wire (int8/fp8 codes plus
            one fp32 scale per block; bf16 gradients), and what its quantize / dequantize passes
            cost per byte they move (e.g. 1 / memory bandwidth on a GPU).
    """
    specs = measure.describe_units(model, unit_classes)
    notes = []
    if loss_fn is not None and activation_bytes is None:
        measured = measure.measure_activations(model, specs, lambda: loss_fn(model))
        notes.append(f"activations: {measured / 2**20:.1f} MiB saved for backward per forward "
                     "(measured on the given batch)")
    elif activation_bytes is not None:
        _spread(specs, activation_bytes)
        notes.append(f"activations: {activation_bytes / 2**20:.1f} MiB per rank (given)")
    together = link is None and device_type == "cpu" and dist.is_available() and dist.is_initialized()
    if compute_s is None and flops_per_step is not None and flop_rate:
        compute_s = flops_per_step / flop_rate
        notes.append(f"compute: {flops_per_step:.3g} FLOP at {flop_rate:.3g} FLOP/s (given)")
    elif compute_s is None and loss_fn is not None:
        compute_s = measure.measure_compute(lambda: _forward_backward(model, loss_fn),
                                                 together=together)
        notes.append(f"compute: forward + backward measured on this machine"
                     f"{', all ranks at once' if together else ''}: {compute_s:.3f} s")
    elif compute_s is not None:
        notes.append(f"compute: {compute_s:.3f} s (given)")
    if compute_s is None:
        raise ValueError("plan needs loss_fn, compute_s or flops_per_step + flop_rate")
    if link is None:
        link = _default_link(device_type)
    threads = threads_per_rank or torch.get_num_threads()
    hides = device_type != "cpu" or not cpu_saturated(world_size, threads, ranks_per_node)
    itemsize = next((p.element_size() for p in model.parameters()), 4)
    inputs = PlanInputs(
        units=specs, world_size=world_size, compute_s=compute_s,
        adamw_s_per_element=(adamw_s_per_element if adamw_s_per_element is not None
                             else measure.adamw_seconds_per_element()), link=link,
        cross_link=cross_link, per_node=ranks_per_node or 0,
        param_bytes=_size(param_dtype, itemsize), reduce_bytes=_size(reduce_dtype or param_dtype,
                                                                     itemsize),
        state_bytes=itemsize, comm_hides=hides,
        copy_bytes_per_s=measure.copy_bytes_per_second() if device_type == "cpu" else 0.0,
        reduce_is_all_reduce=device_type == "cpu")  # gloo: an in-place all-reduce (runtime/comm/collectives.py)
    if comm_policy is not None:
        per_scale = 4 / comm_policy.block_size
        if comm_policy.param_gather is not None:
            inputs.wire_param_bytes = 1 + per_scale
        if comm_policy.grad_reduce == "int8":
            inputs.wire_reduce_bytes = 1 + per_scale
        elif comm_policy.grad_reduce == "bf16":
            inputs.reduce_bytes = 2
        inputs.quant_s_per_byte = quant_s_per_byte
        notes.append(f"CommPolicy: {comm_policy.describe()}")
    if not hides:
        inputs.contention = _contention(model, loss_fn, inputs, together, notes)
    return build_plan(inputs, memory_budget, prefetch, strategies, notes)


def _contention(model, loss_fn, inputs: PlanInputs, together: bool, notes: list[str]) -> float:
    """CPU ranks fill every core: measure how much overlapped communication still costs, with a
    probe as long as the default setting's communication (at most the compute), when every rank
    is here to measure it with; otherwise count communication in full."""
    if not (together and loss_fn is not None):
        notes.append("communication counted in full: the ranks' compute threads fill every core")
        return 1.0
    comm = estimate_time(inputs, Setting("FULL_SHARD", 1))["comm"]
    largest = max(padded_numel(u, inputs.world_size) for u in inputs.units)
    contention = measure.measure_contention(
        lambda: _forward_backward(model, loss_fn), largest, min(comm, inputs.compute_s))
    notes.append(f"the ranks' compute threads fill every core: {contention:.2f} of the "
                 "communication overlapped with compute still adds to the step (measured)")
    return contention


def project(model: nn.Module, world_sizes, cluster: Cluster, *, unit_classes=None,
            flops_per_step: float, activation_bytes: int, param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32, prefetch=(1,), strategies=("FULL_SHARD", "HYBRID_SHARD"),
            comm_policy=None):
    """PROJECTION, nothing measured: one Plan per world size on `cluster` (stated link bandwidths,
    peak FLOP/s x assumed MFU). `model` may live on the meta device; the per-GPU batch is fixed
    (flops_per_step and activation_bytes are per GPU), so larger worlds train more tokens."""
    plans = {}
    for world in world_sizes:
        plans[world] = plan(
            model, world, unit_classes=unit_classes, activation_bytes=activation_bytes,
            flops_per_step=flops_per_step, flop_rate=cluster.peak_flops * cluster.mfu,
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, memory_budget=cluster.memory_bytes,
            link=cluster.link_for(world), cross_link=cluster.inter, ranks_per_node=cluster.per_node,
            device_type="cuda", adamw_s_per_element=cluster.adamw_s_per_element,
            prefetch=prefetch, strategies=strategies, comm_policy=comm_policy,
            quant_s_per_byte=1 / cluster.memory_bandwidth)
    return plans


def _forward_backward(model: nn.Module, loss_fn) -> None:
    loss_fn(model).backward()
    for p in model.parameters():
        p.grad = None


def _spread(specs, total: int) -> None:
    """Given activations, attributed to units by parameter count (the planner's only use of the
    split is the order in which backward frees them)."""
    blocks = [s for s in specs if not s.is_root] or specs
    numel = sum(s.numel for s in blocks) or 1
    for s in specs:
        s.activation_bytes = total * s.numel // numel if s in blocks else 0


def _size(dtype: torch.dtype | None, default: int) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype is not None else default


def _default_link(device_type: str) -> Link:
    if dist.is_available() and dist.is_initialized() and device_type == "cpu":
        return measure.measure_link()
    return GLOO_LOOPBACK
