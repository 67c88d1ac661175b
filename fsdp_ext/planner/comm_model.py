"""An alpha-beta model of the collectives the runtime issues, for the planner.

A ring collective over W ranks takes W - 1 steps; in each step every rank sends one chunk of
`bytes / W` to its neighbour, so

    all-gather(bytes)      = (W - 1) * alpha + (W - 1) / W * bytes / bandwidth
    reduce-scatter(bytes)  = the same (bytes = the full, unsharded size)
    all-reduce(bytes)      = 2 * that (a reduce-scatter followed by an all-gather)

with alpha the latency of one step and bandwidth what one rank can send while it receives as much
(NCCL's "bus bandwidth"). A ring that leaves a node runs at the slowest link it crosses, so a
cluster is described by its intra-node and inter-node links (`Cluster.link_for`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    name: str
    alpha_s: float        # seconds per ring step (latency)
    bandwidth: float      # bytes per second one rank sends (while receiving as much)


@dataclass(frozen=True)
class Cluster:
    """Accelerators for projections: `per_node` devices on a fast link, nodes on a slower one."""

    name: str
    per_node: int
    intra: Link
    inter: Link
    memory_bytes: float   # per device
    peak_flops: float     # per device, dense, in the compute dtype
    mfu: float            # assumed fraction of peak the model's compute reaches
    memory_bandwidth: float = 0.0  # bytes/s per device (the optimizer step is bound by it)

    @property
    def adamw_s_per_element(self) -> float:
        """AdamW reads parameter, gradient and two moments and writes three back: 28 bytes of fp32
        traffic per element at the memory bandwidth."""
        return 28 / self.memory_bandwidth

    def link_for(self, world_size: int) -> Link:
        return self.intra if world_size <= self.per_node else self.inter


# Stated figures, not measurements: H100 SXM, NVLink 4 at 450 GB/s per direction per GPU inside a
# node, one 400 Gb/s InfiniBand NIC per GPU (50 GB/s) between nodes; 989 TFLOP/s dense bf16 and
# 3.35 TB/s of HBM3; a model FLOP utilisation of 40% (typical of well-tuned FSDP training).
H100 = Cluster(
    name="H100 SXM, 8 per node: NVLink 450 GB/s, 400 Gb/s IB per GPU",
    per_node=8,
    intra=Link("NVLink", alpha_s=10e-6, bandwidth=450e9),
    inter=Link("InfiniBand 400 Gb/s", alpha_s=20e-6, bandwidth=50e9),
    memory_bytes=80e9, peak_flops=989e12, mfu=0.40, memory_bandwidth=3.35e12)


def all_gather_s(full_bytes: float, world_size: int, link: Link) -> float:
    """Gather `full_bytes` (the unsharded size) from `world_size` equal shards."""
    if world_size <= 1:
        return 0.0
    steps = world_size - 1
    return steps * link.alpha_s + steps / world_size * full_bytes / link.bandwidth


def reduce_scatter_s(full_bytes: float, world_size: int, link: Link) -> float:
    return all_gather_s(full_bytes, world_size, link)


def all_reduce_s(full_bytes: float, world_size: int, link: Link) -> float:
    return 2 * all_gather_s(full_bytes, world_size, link)


# Seconds of each collective kind from (full bytes, world size, link), for models that replay
# collectives by kind (diagnostics/gpu_projection.py takes this as its `collective_s`).
RING_FORMULAS = {"all_gather": all_gather_s, "reduce_scatter": reduce_scatter_s,
                 "all_reduce": all_reduce_s}


def fit_link(samples: list[tuple[float, float]], world_size: int, name: str) -> Link:
    """Least-squares alpha and bandwidth from measured (full_bytes, all-gather seconds) pairs."""
    steps = world_size - 1
    xs = [steps / world_size * b for b, _ in samples]   # bytes each rank sends
    ys = [t for _, t in samples]
    n = len(samples)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    slope = max(slope, 1e-15)
    alpha = max((my - slope * mx) / steps, 0.0)
    return Link(name, alpha_s=alpha, bandwidth=1.0 / slope)
