"""The kernel benchmark runs end to end (--quick, torch backend) and writes the rows it promises."""
import importlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNITS = {"block_1b", "small_1000", "large_256mb"}
CASES = {"pack fp32->fp32", "pack fp32->bf16", "pack fp32->fp32 x0.125", "unpack fp32->fp32",
         "cast_into_slot fp32->bf16", "grad_epilogue bf16->fp32 /3 +="}
QUANT_CASES = {*(f"quantize_into {v}->{c}" for v in ("fp32", "bf16", "fp16") for c in ("int8", "fp8")),
               "dequantize_from int8->fp32", "dequantize_from fp8->fp32",
               "dequantize_sum int8->fp32 w4", "dequantize_sum fp8->fp32 w4"}  # no foreach one


def test_quick_benchmark_writes_expected_rows(tmp_path):
    out = tmp_path / "kernels.json"
    # A subprocess, as users run it; the env keeps a stray TRITON_INTERPRET from leaking in.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.bench_kernels", "--quick",
         "--backends", "torch", "--threads", "1", "--repeats", "2", "--warmup", "1",
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| threads | unit | case |" in result.stdout  # the markdown table

    report = json.loads(out.read_text())
    assert report["quick"] and report["backends"] == ["torch"]
    rows = report["rows"]
    assert {(r["unit"], r["case"]) for r in rows} == {(u, c) for u in UNITS
                                                      for c in CASES | QUANT_CASES}
    for r in rows:
        if r["case"] in QUANT_CASES:
            assert r["median_ms"] > 0 and r["gbps"] > 0 and r["vs_copy"] > 0
            assert r["kind"] in ("fsdp_ext", "limit") and r["speedup_vs_foreach"] is None
    for unit in UNITS:
        for case in CASES:
            impls = {r["impl"]: r for r in rows if r["unit"] == unit and r["case"] == case}
            assert {"torch", "copy_ (limit)"} <= impls.keys()
            assert sum(r["kind"] == "foreach" for r in impls.values()) == 1
            for r in impls.values():
                assert r["median_ms"] > 0 and r["gbps"] > 0 and r["vs_copy"] > 0
                assert r["speedup_vs_foreach"] > 0 and r["threads"] == 1
    pack = {r["impl"] for r in rows if r["unit"] == "small_1000" and r["case"] == "pack fp32->bf16"}
    assert {"torch._foreach_copy_", "torch.cat().to()", "torch._chunk_cat"} <= pack
    unpack = {r["impl"] for r in rows if r["case"] == "unpack fp32->fp32"}
    assert "torch.split_with_sizes_copy" in unpack
    assert report["targets"] == []  # targets concern the compiled backends only


def test_merge_combines_runs(tmp_path):
    """--merge joins runs (e.g. one per thread count) without re-running anything."""
    bench = importlib.import_module("benchmarks.kernels.bench_kernels")
    rows = [dict(threads=t, unit="small_1000", case="pack fp32->fp32", impl="cpp", kind="fsdp_ext",
                 median_ms=1.0, gbps=1.0, vs_copy=0.5, speedup_vs_foreach=2.5) for t in (1, 2)]
    paths = []
    for t, row in zip((1, 2), rows):
        run = dict(machine=dict(device="cpu", cpu="x", cpu_count=2, torch="t",
                                load_average_at_start=[0.1, 0, 0], load_average_at_end=[0.2, 0, 0]),
                   quick=False, repeats=3, warmup=1, backends=["cpp"], notes=[], units={},
                   rows=[row], targets=[])
        paths.append(tmp_path / f"run{t}.json")
        paths[-1].write_text(json.dumps(run))
    out, md = tmp_path / "merged.json", tmp_path / "merged.md"
    bench.main(["--merge", *map(str, paths), "--out", str(out), "--md", str(md)])
    merged = json.loads(out.read_text())
    assert [r["threads"] for r in merged["rows"]] == [1, 2]
    assert [t["met"] for t in merged["targets"]] == [True, True]
    assert "0.10 -> 0.20, 0.10 -> 0.20" in md.read_text()
