"""The modelled GPU timeline (fsdp_ext/diagnostics/gpu_projection.py, a PROJECTION) and the step
recorder it replays (fsdp_ext/diagnostics/launch_trace.py).

1. The replay on hand-written traces, against hand-computed times: a host sync leaves the compute
   stream idle for exactly the host's launch time of what follows it; a collective overlapped by
   compute is not exposed, the part the compute stream waits for is; the host's run-ahead.
2. Recording: a sync announced by the host-sync counter (`on_host_sync`) and then seen by the
   model is one record; one small recording (a tiny GPT, world 2, under the stream-order model):
   the CPU stand-ins are recorded as the GPU's collectives, and the synchronous tags
   (FSDP_EXT_CHECK=sync) leave the compute stream idler than no tags (FSDP_EXT_CHECK=off).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from fsdp_ext.diagnostics import gpu_projection as gp
from fsdp_ext.diagnostics.launch_trace import (EventRecord, EventWait, HostSync, Launch,
                                               LaunchRecorder, LaunchTrace, Mark, StreamWait)
from fsdp_ext.planner.comm_model import H100, RING_FORMULAS, Cluster, Link

from ..helpers.dist import run_distributed

US = 1e-6
# Round numbers: 1e6 FLOPs or 1000 bytes take 1 us; an all-gather over 2 ranks takes
# 5 us + bytes / 2 / 1e9 (one ring step).
CLUSTER = Cluster("test", per_node=8, intra=Link("test", alpha_s=5 * US, bandwidth=1e9),
                  inter=Link("test", alpha_s=5 * US, bandwidth=1e9), memory_bytes=1e12,
                  peak_flops=1e12, mfu=1.0, memory_bandwidth=1e9)
COSTS = gp.CostModel(CLUSTER, RING_FORMULAS, world_size=2, kernel_floor_s=0.0,
                     host_launch_s=10 * US, host_other_s=2 * US, fp32_matmul_fraction=1.0)
COMPUTE = "compute (cuda:0)"


def kernel(us: float, unit: str = "a", stream: str = COMPUTE, **kwargs) -> Launch:
    """A matmul of `us` microseconds at the test model's rates."""
    return Launch(stream, "aten.mm", unit, "forward", flops=us * 1e6, dtype="bfloat16", **kwargs)


def view() -> Launch:
    return Launch(COMPUTE, "aten.view", "a", "forward", kernel=False)


def project(*records) -> gp.Projection:
    return gp.replay(LaunchTrace(list(records), recorded_world=2), COSTS)


def approx(x: float):
    return pytest.approx(x, abs=1e-9)


# ---- 1. the replay on hand-written traces -------------------------------------------------------
def test_queued_kernels_run_back_to_back():
    # launched at 10, 20, 30 us: the first starts at once, the others queue behind it
    p = project(kernel(100), kernel(100), kernel(100))
    assert [(x.start / US, x.end / US) for x in p.placed] == [approx(v) for v in [
        (10, 110), (110, 210), (210, 310)]]
    gaps = gp.compute_gaps(p)
    assert [(g.start / US, g.end / US, g.cause) for g in gaps] == [(0, approx(10), "host")]
    assert p.step_s == approx(310 * US)


def test_host_sync_leaves_a_gap_of_the_launches_after_it():
    # Two kernels queued (10-110, 110-210); the host waits for the compute stream (until 210),
    # then runs 5 view ops (2 us each) and launches the next kernel (10 us): the stream idles
    # from 210 to 230, 20 us, and the host was blocked from 22 (after 2 launches and the sync
    # call) to 210.
    p = project(kernel(100), kernel(100), HostSync(COMPUTE, None, "test", "here"),
                *[view() for _ in range(5)], kernel(100))
    gaps = gp.compute_gaps(p)
    assert [(g.start / US, g.end / US, g.cause) for g in gaps] == [
        (0, approx(10), "host"), (approx(210), approx(230), "sync")]
    assert [(a / US, b / US) for a, b, _ in p.host_waits] == [(approx(22), approx(210))]
    s = gp.summarize(p)
    assert s["idle_sync_s"] == approx(20 * US) and s["largest_gap_s"] == approx(20 * US)
    assert s["idle_host_s"] == approx(10 * US)  # the step's first launch
    assert s["host_syncs"] == 1 and s["host_blocking_syncs"] == 1
    # Without the sync the third kernel is queued at 32 and follows the second at once.
    assert gp.compute_gaps(project(kernel(100), kernel(100), *[view() for _ in range(5)],
                                   kernel(100)))[1:] == []


def test_event_synchronize_waits_for_the_event_only():
    # The host waits for the event after the first kernel (end 110), not for the second (210):
    # it launches the third at 120, still ahead of the GPU, so no gap after the first.
    p = project(kernel(100), EventRecord(COMPUTE, 1), kernel(100),
                HostSync(COMPUTE, 1, "event.synchronize", "here"), kernel(100))
    assert [(a / US, b / US) for a, b, _ in p.host_waits] == [(approx(24), approx(110))]
    assert p.placed[2].issue == approx(120 * US) and p.placed[2].start == approx(210 * US)
    assert gp.compute_gaps(p)[1:] == []


def test_syncing_op_blocks_the_host_until_it_ends():
    p = project(kernel(100), Launch(COMPUTE, "aten._local_scalar_dense", "a", "forward",
                                    bytes=4000, sync="item"), kernel(100))
    # item: launched at 20, runs 110-114; the next kernel is launched at 124
    assert p.placed[2].issue == approx(124 * US) and p.placed[2].start == approx(124 * US)
    assert [(g.start / US, g.end / US) for g in gp.compute_gaps(p)][1:] == [
        (approx(114), approx(124))]


def gather(unit: str, nbytes: float) -> Launch:
    return Launch("all_gather", "c10d._allgather_base_", unit, "forward", "all_gather",
                  bytes=nbytes, collective="all_gather", group_size=2)


def test_collective_under_compute_is_not_exposed():
    # compute 10-110; the all-gather (launched at 20, 5 + 45 us) runs 20-70, inside it; the next
    # kernel waits for its event (70) and its stream (110): no gap.
    p = project(kernel(100), gather("b", 90_000), EventRecord("all_gather", 1),
                EventWait(COMPUTE, 1), kernel(100, unit="b"))
    comm = gp.exposed_comm(p)
    assert comm[("b", "all_gather")]["seconds"] == approx(50 * US)
    assert comm[("b", "all_gather")]["exposed"] == approx(0)
    assert gp.compute_gaps(p)[1:] == []


def test_the_part_compute_waits_for_is_exposed():
    # The all-gather runs 20-220 (5 + 195 us); compute ends at 110 and waits for it until 220.
    p = project(kernel(100), gather("b", 390_000), EventRecord("all_gather", 1),
                EventWait(COMPUTE, 1), kernel(100, unit="b"))
    assert gp.exposed_comm(p)[("b", "all_gather")]["exposed"] == approx(110 * US)
    gap = gp.compute_gaps(p)[1]
    assert (gap.start / US, gap.end / US, gap.cause, gap.of) == (
        approx(110), approx(220), "comm", ("b", "all_gather"))
    assert gp.summarize(p)["comm"]["all_gather"]["exposed"] == approx(110 * US)


def test_side_stream_waits_for_compute_before_it_starts():
    # wait_stream: the all-gather cannot start before the compute kernel queued before it ends.
    p = project(kernel(100), StreamWait("all_gather", COMPUTE), gather("b", 10_000))
    assert p.placed[1].start == approx(110 * US) and p.placed[1].cause == COMPUTE


def test_host_run_ahead():
    # launched at 10, 20, 30, 40 us; started at 10, 110, 210, 310: 0, 90, 180, 270 us ahead
    s = gp.summarize(project(*[kernel(100) for _ in range(4)]))
    assert s["run_ahead_min_s"] == approx(0)
    assert s["run_ahead_median_s"] == approx(135 * US)
    assert s["starved_launches"] == 1


def test_shard_sized_work_scales_with_the_world_size():
    opt = Launch(COMPUTE, "aten._foreach_add_", None, "optimizer", bytes=8000, per_shard=True)
    # recorded at world 2, projected to 8 ranks: a quarter of the bytes
    assert gp.CostModel(CLUSTER, RING_FORMULAS, world_size=8, kernel_floor_s=0.0).gpu_seconds(
        opt, 2) == approx(2 * US)


def test_trace_round_trip_and_projection_png(tmp_path):
    trace = LaunchTrace([Mark("forward.begin", ""), kernel(100, unit=""), HostSync(
        None, None, "test", "here"), StreamWait("all_gather", COMPUTE), gather("", 90_000),
        EventRecord("all_gather", 1), EventWait(COMPUTE, 1), kernel(100, unit="")],
        recorded_world=2, iteration=3, meta=dict(check="sync"))
    trace.save(str(tmp_path / "t.json"))
    again = LaunchTrace.load(str(tmp_path / "t.json"))
    assert again == trace
    p = gp.replay(again, COSTS)
    spans = gp.to_spans(p)
    assert {s.lane for s in spans} == {"host", "compute", "all_gather"}
    assert any(s.label == "sync" for s in spans)
    gp.draw([p, p], ["before", "after"], str(tmp_path / "t.png"), "test")
    assert os.path.getsize(tmp_path / "t.png") > 0


# ---- 2. recording -------------------------------------------------------------------------------
def test_a_sync_announced_by_on_host_sync_is_recorded_once():
    """The model announces its own event synchronize through the host-sync counter
    (on_host_sync), then records it: one record, with the event and the counter's call site."""
    recorder = LaunchRecorder(iteration=3)
    recorder.iteration_started(None, 3)
    stream = recorder.new_stream(torch.device("cpu"), name="all_gather")
    event = recorder.record_event(stream)
    recorder.synchronize(event)
    recorder.on_host_sync(None, "device synchronize", "caller.py:2", True)
    recorder.stop()
    syncs = [r for r in recorder.records if isinstance(r, HostSync)]
    assert [(r.stream, r.event, r.kind) for r in syncs] == [
        ("all_gather", 1, "Event.synchronize"), (None, None, "device synchronize")], syncs
    assert syncs[0].site.startswith("tests/diagnostics/test_gpu_projection.py:")
    assert syncs[0].site.endswith("(test_a_sync_announced_by_on_host_sync_is_recorded_once)")


def record_worker(rank: int, world_size: int, out_dir: str) -> None:
    """A tiny GPT's second step, recorded with the tags on the device (the default), synchronous
    and off."""
    import fsdp_ext
    from fsdp_ext.diagnostics.stream_check import stream_check
    from fsdp_ext.env import CHECK as CHECK_ENV
    from fsdp_ext.runtime.core.trace import RECORDER
    from examples.models import GPT, GPTConfig

    for mode in ("on", "sync", "off"):
        os.environ[CHECK_ENV] = mode  # read at each fully_shard (fsdp_ext/env.py)
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=53, block_size=8, n_layer=2, n_head=2, d_model=16))
        for block in model.blocks:
            fsdp_ext.fully_shard(block)
        fsdp_ext.fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        recorder = LaunchRecorder(iteration=2)
        with stream_check(model=recorder):
            for step in range(2):
                idx = torch.randint(0, 53, (2, 8), generator=torch.Generator().manual_seed(step))
                model(idx, idx).backward()
                optimizer.step()
                optimizer.zero_grad()
            recorder.stop()
        assert not RECORDER.enabled and not RECORDER.events  # left as it was
        if rank == 0:
            recorder.trace().save(os.path.join(out_dir, f"{mode}.json"))
    os.environ.pop(CHECK_ENV)
    dist.barrier()


def test_recorded_step_sync_tags_leave_compute_idler(tmp_path):
    run_distributed(record_worker, 2, str(tmp_path))
    traces = {m: LaunchTrace.load(str(tmp_path / f"{m}.json")) for m in ("on", "sync", "off")}
    for trace in traces.values():
        launches = [r for r in trace.records if isinstance(r, Launch)]
        assert trace.recorded_world == 2
        # CPU stand-ins recorded as the GPU's collectives: one all-gather per gathered buffer
        # (not a broadcast per rank), one reduce-scatter per unit (not an all-reduce)
        data = [r for r in launches if r.collective and r.dtype != "int64"]  # not the tags
        assert {(r.role, r.collective) for r in data} == {("all_gather", "all_gather"),
                                                          ("reduce_scatter", "reduce_scatter")}
        assert all(r.group_size == 2 for r in data)
        assert len([r for r in data if r.role == "reduce_scatter"]) == 3  # root + 2 blocks
        assert {r.unit for r in data} == {"", "blocks.0", "blocks.1"}
        assert any(r.phase == "optimizer" and r.per_shard for r in launches)
    costs = gp.CostModel(H100, RING_FORMULAS)  # 8 GPUs in a node
    on, sync, off = (gp.summarize(gp.replay(traces[m], costs)) for m in ("on", "sync", "off"))
    # the tags' checks wait for their events, and say where
    assert all("collective_tags.py" in r.site for r in traces["sync"].records
               if isinstance(r, HostSync))
    assert sync["host_syncs"] > 0 and sync["host_blocked_s"] > 0
    assert off["host_syncs"] == 0 and off["host_blocked_s"] == 0
    assert sync["idle_s"] > off["idle_s"]
    # on the device: one host sync in the step, the flags' read at the end of backward
    syncs = [r.site for r in traces["on"].records if isinstance(r, HostSync)]
    assert len(syncs) == 1 and syncs[0].endswith("(wait_bounded)"), syncs  # read_flags' wait
    assert on["host_syncs"] == 1 < sync["host_syncs"]
