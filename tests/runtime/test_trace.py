"""The profiler trace labels every collective and every unit's compute, in the FSDP timeline's order,
and the timeline PNG is drawn from it (2 gloo ranks, 2 profiled steps).

The Chrome trace is read as plain JSON here, independently of fsdp_ext.diagnostics.timeline's parser.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import fsdp_ext
from fsdp_ext.diagnostics import timeline
from examples.models import GPT, GPTConfig
from fsdp_ext.runtime.core.trace import recording

from ..helpers.dist import run_distributed

UNITS = ["root", "blocks.0", "blocks.1", "blocks.2"]


def _model(depth: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=3, n_head=2, d_model=16))
    for block in model.blocks:
        fsdp_ext.fully_shard(block, forward_prefetch=depth, backward_prefetch=depth)
    return fsdp_ext.fully_shard(model, forward_prefetch=depth, backward_prefetch=depth)


def _profile_two_steps(model, rank: int, path: str):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(rank))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            recording() as events:
        for _ in range(2):
            model(idx, idx).backward()
            opt.step()
            opt.zero_grad()
        recorded = list(events)
    prof.export_chrome_trace(path)
    with open(path) as f:
        ranges = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    return sorted(ranges, key=lambda e: e["ts"]), recorded


def _spans(ranges, name: str) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"] == name]


def check_labels_and_order(ranges) -> None:
    names = {e["name"] for e in ranges}
    for op in ("fsdp_ext::cast_into_slot", "fsdp_ext::pack", "fsdp_ext::grad_epilogue"):
        assert op in names, f"copy kernel {op} missing from the trace"
    for unit in UNITS:
        ag, ag_wait = _spans(ranges, f"fsdp_ext::all_gather[{unit}]"), \
            _spans(ranges, f"fsdp_ext::all_gather.wait[{unit}]")
        fwd, bwd = _spans(ranges, f"fsdp_ext::forward[{unit}]"), \
            _spans(ranges, f"fsdp_ext::backward[{unit}]")
        rs = _spans(ranges, f"fsdp_ext::reduce_scatter[{unit}]")
        assert len(fwd) == len(bwd) == len(rs) == 2, (unit, len(fwd), len(bwd), len(rs))
        for step in range(2):
            # The unit's parameters are gathered (issued and waited for) before its compute.
            issued = [s for s, _ in ag if s < fwd[step][0] and (step == 0 or s > bwd[0][1])]
            assert issued, f"step {step}: no all-gather of {unit} before its forward"
            assert any(issued[-1] <= s and e <= fwd[step][0] for s, e in ag_wait), (
                f"step {step}: {unit}'s forward began before its all-gather was waited for")
            # Its gradients are reduce-scattered after its backward compute, not before.
            assert rs[step][0] >= bwd[step][1], f"step {step}: {unit} reduce-scattered early"
            assert fwd[step][1] < bwd[step][0], f"step {step}: {unit} backward before forward"
    root_fwd = _spans(ranges, "fsdp_ext::forward[root]")
    for unit in UNITS[1:]:  # every block computes inside the root's forward
        for (s, e), (rs_, re_) in zip(_spans(ranges, f"fsdp_ext::forward[{unit}]"), root_fwd):
            assert rs_ <= s and e <= re_, f"{unit}'s forward is outside the root's"


def prefetched(ranges, step: int) -> bool:
    """In `step`, blocks.1's all-gather was issued before blocks.0's forward compute ended."""
    fwd0 = _spans(ranges, "fsdp_ext::forward[blocks.0]")[step]
    starts = [s for s, _ in _spans(ranges, "fsdp_ext::all_gather[blocks.1]")
              if s > _spans(ranges, "fsdp_ext::forward[root]")[step][0]]
    return bool(starts) and starts[0] < fwd0[1]


def trace_worker(rank: int, world: int, out_dir: str) -> None:
    ranges, recorded = _profile_two_steps(_model(1), rank, os.path.join(out_dir, f"t{rank}.json"))
    check_labels_and_order(ranges)
    # The first step learns the order (no prefetch possible); the second one prefetches.
    assert not prefetched(ranges, 0) and prefetched(ranges, 1)
    ranges0, _ = _profile_two_steps(_model(0), rank, os.path.join(out_dir, f"d0_{rank}.json"))
    check_labels_and_order(ranges0)
    assert not prefetched(ranges0, 1), "depth 0 must not prefetch: the check above is vacuous"

    # The runtime's own record and the profiler trace describe the same collectives.
    from_trace = timeline.events_from_chrome_trace(os.path.join(out_dir, f"t{rank}.json"))

    def bars(events):
        return [(s.lane, s.label) for s in timeline.spans(timeline.last_step(events))
                if s.lane != "compute" and not s.exposed]

    assert bars(recorded) == bars(from_trace), (bars(recorded), bars(from_trace))
    assert ("all_gather", "AG2") in bars(recorded) and ("reduce_scatter", "RS0") in bars(recorded)

    # NO_SHARD gathers nothing: the trace shows a local copy, not an all-gather.
    torch.manual_seed(0)
    no_shard = fsdp_ext.FullyShardedDataParallel(
        GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=2, d_model=16)),
        auto_wrap_policy=fsdp_ext.ModuleWrapPolicy({type(_model(1).blocks[0])}),
        sharding_strategy=fsdp_ext.ShardingStrategy.NO_SHARD)
    ranges_ns, recorded_ns = _profile_two_steps(no_shard, rank,
                                                os.path.join(out_dir, f"ns{rank}.json"))
    names = {e["name"] for e in ranges_ns}
    assert not any(n.startswith("fsdp_ext::all_gather") for n in names), sorted(names)
    assert not any(e.kind.startswith("all_gather") for e in recorded_ns)
    assert "fsdp_ext::unshard_copy[root]" in names, sorted(names)
    assert "fsdp_ext::reduce_scatter[root]" in names, sorted(names)

    per_rank = timeline.gather_to_rank0(timeline.last_step(recorded))
    if rank == 0:
        assert len(per_rank) == world
        timeline.draw(per_rank, os.path.join(out_dir, "timeline.png"), "test")
    dist.barrier()


def test_trace_order_and_timeline_png(tmp_path):
    run_distributed(trace_worker, 2, str(tmp_path))
    png = tmp_path / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert width > 1000 and height > 300, (width, height)
    # Not a blank canvas: many distinct colours (bars, labels, legend).
    pixels = matplotlib.image.imread(str(png)).reshape(-1, 4)[::7]
    assert len({tuple(p) for p in pixels.tolist()}) > 20


def test_timeline_labels_never_overlap(tmp_path):
    """Narrow neighbouring segments (the root's FWD0 just before BWD0, as around the loss) get at
    most one label between them; labels on one sub-row never overlap, wide bars keep theirs."""
    from fsdp_ext.runtime.core.trace import Event

    events, t = [], 0.0
    for kind, unit, dt in [("forward.begin", "", 0.0), ("forward.begin", "blocks.0", 0.004),
                           ("forward.end", "blocks.0", 0.100), ("forward.end", "", 0.004),
                           ("backward.begin", "", 0.0), ("backward.begin", "blocks.0", 0.004),
                           ("backward.end", "blocks.0", 0.200), ("backward.end", "", 0.004)]:
        t += dt
        events.append(Event(kind, unit, t))
    placed = timeline.draw([events, events], str(tmp_path / "t.png"))
    labels = [label for label, _, _, _ in placed]
    assert labels.count("FWD1") == 2 and labels.count("BWD1") == 2, labels  # the wide ones
    # the 4 ms root segments around the loss: four candidates, room for at most one per rank
    assert labels.count("FWD0") + labels.count("BWD0") <= 2, labels
    rows = {}
    for _, row, left, right in placed:
        rows.setdefault(row, []).append((left, right))
    for boxes in rows.values():
        boxes.sort()
        assert all(right <= next_left for (_, right), (next_left, _) in zip(boxes, boxes[1:]))
