"""The overlap, host-time and Trainer benchmarks run end to end at a tiny size and write what they
promise: a row per configuration with every framework's timing, the fsdp_ext and FSDP2 columns
included."""
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tool  # benchmark scripts: last in a time-boxed slow tier (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m benchmarks.MODULE ARGS` from the top of the checkout, as the docs run it."""
    result = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_overlap_benchmark_writes_every_column(tmp_path):
    _run("overlap.bench_overlap", "--kinds", "sleep", "--sizes", "64", "--matmuls", "1",
         "--sleep-ms", "0.5", "--units", "3", "--reps", "1", "--out", str(tmp_path))
    report = json.loads((tmp_path / "overlap.json").read_text())
    (row,) = report["rows"]
    assert (row["kind"], row["d"], row["matmuls"], row["units"]) == ("sleep", 64, 1, 3)
    for key in ("exposed_depth0", "exposed_depth1", "exposed_depth2", "fsdp2_exposed_depth0",
                "fsdp2_exposed_depth1", "fsdp2_exposed_depth1_async", "forward_ratio_depth1"):
        assert math.isfinite(row[key]), key
    assert row["comm_per_unit_ms"] > 0 and row["fsdp2_comm_per_unit_ms"] > 0
    assert row["compute_per_unit_ms"] >= 0.5  # the unit sleeps 0.5 ms
    assert {len(v) for v in row["samples"].values()} == {1} and len(row["samples"]) == 9
    text = (tmp_path / "overlap.md").read_text()
    assert "FSDP2 exposed, depth 1, async unshard" in text
    assert (tmp_path / "overlap.png").stat().st_size > 0


@pytest.mark.slow
def test_host_overhead_benchmark_times_every_framework(tmp_path):
    result = _run("host.host_overhead", "--units", "4", "--reps", "1", "--out", str(tmp_path))
    report = json.loads((tmp_path / "host_overhead_w1.json").read_text())
    per_unit = report["seconds_per_unit"]
    assert set(per_unit) == {f"{name}/{mode}" for name in ("plain", "fsdp_ext", "fsdp_ext inline",
                                                           "fsdp2")
                             for mode in ("train", "no_grad")}
    assert all(v > 0 for v in per_unit.values())
    assert "| forward + backward |" in result.stdout


@pytest.mark.slow
def test_tag_cost_benchmark_times_every_variant(tmp_path):
    result = _run("host.tag_cost", "--collectives", "20", "--reps", "1", "--rounds", "1",
                  "--out", str(tmp_path))
    report = json.loads((tmp_path / "tag_cost.json").read_text())
    (rounds,) = report["us_per_collective"].values()
    assert set(rounds[0]) == {"issue", "tag", "no tag"}
    assert all(v["cpu"] > 0 and v["wall"] > 0 for v in rounds[0].values())
    assert "| this checkout |" in result.stdout

@pytest.mark.slow
def test_trainer_benchmark_times_every_implementation(tmp_path):
    pytest.importorskip("accelerate")
    _run("step.trainer_step", "--layers", "1", "--hidden", "64", "--steps", "3", "--warmup", "1",
         "--runs", "1", "--out", str(tmp_path), "--dir", str(tmp_path / "runs"))
    report = json.loads((tmp_path / "trainer_step_w2.json").read_text())
    wrapped = {impl: runs[0][0]["sharded_by"] for impl, runs in report["results"].items()}
    assert wrapped == {"ddp": "torch", "torch": "torch", "fsdp_ext": "fsdp_ext"}, wrapped
    for runs in report["results"].values():
        assert all(rank["step_s"] > 0 and rank["peak_rss"] > 0 for rank in runs[0])
    assert "fsdp_ext ÷ this" in (tmp_path / "trainer_step_w2.md").read_text()


@pytest.mark.slow
def test_gpu_projection_benchmark_projects_every_mode(tmp_path):
    _run("planner.project_gpu_step", "--layers", "1", "--hidden", "64", "--ffn", "128", "--seq",
         "32", "--out", str(tmp_path))
    report = json.loads((tmp_path / "gpu_projection.json").read_text())
    assert report["label"] == "PROJECTION, not measured"
    modes = report["modes"]
    assert [m["check"] for m in modes.values()] == [None, "sync", "off"]
    for mode in modes.values():
        assert mode["summary"]["step_s"] > 0 and mode["summary"]["compute_busy_s"] > 0
    # the runtime's own syncs (the model's, e.g. transformers' mask checks, are the script's):
    # none without tags, the flags' one read per step with them on the device, more in sync mode
    runtime = {name: mode["summary"]["runtime_host_syncs"] for name, mode in modes.items()}
    assert runtime == {"tags: default": 1, "tags: sync": runtime["tags: sync"], "no tags (off)": 0}
    assert runtime["tags: sync"] > 1
    assert all(m["summary"]["host_syncs"] >= runtime[name] for name, m in modes.items())
    assert "PROJECTION" in (tmp_path / "gpu_projection.md").read_text()
    assert (tmp_path / "gpu_projection.png").stat().st_size > 0


@pytest.mark.slow
def test_moe_step_benchmark_counts_the_expert_padding(tmp_path):
    """World 4 with 2 experts: every variant timed, Shard(0) experts gather twice the
    experts' bytes of Shard(1), and under EP=2 each rank gathers its one expert over 2 ranks:
    half (the script itself asserts the measured differences are the computed ones); only the
    EP variants exchange tokens by all-to-all."""
    _run("step.moe_step", "--world-sizes", "4", "--steps", "1", "--warmup", "1",
         "--out", str(tmp_path))
    res = json.loads((tmp_path / "moe_step.json").read_text())["results"]["4"]
    assert set(res) == {"fsdp_ext", "torch", "fsdp_ext-shard0", "torch-shard0", "fsdp_ext-ep2",
                        "torch-ep2"}
    for impl in ("fsdp_ext", "torch"):
        assert (res[impl]["expert_dim"], res[f"{impl}-shard0"]["expert_dim"]) == (1, 0)
        assert res[f"{impl}-shard0"]["expert_bytes"] == 2 * res[impl]["expert_bytes"]
        assert 2 * res[f"{impl}-ep2"]["expert_bytes"] == res[impl]["expert_bytes"]
        assert res[impl]["gather_bytes"] == res["fsdp_ext"]["gather_bytes"]
        assert res[f"{impl}-ep2"]["a2a_bytes"] > 0 == res[impl]["a2a_bytes"]
        assert res[impl]["median_s"] > 0 and res[impl]["peak_rss"] > 0
