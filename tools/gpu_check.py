"""`make gpu-check`: the checks to run the day a CUDA GPU is present.

Without a GPU it says so and exits 0, having tested nothing. With one, in order (each step's
command is printed; the exit status is non-zero if any step fails):

  1. the CUDA and Triton kernels against the plain-torch reference on the device
     (tests/ops/test_ops_cuda.py, tests/ops/test_ops_triton.py with TRITON_INTERPRET unset,
     tests/ops/test_ops_quantized.py: the quantized collectives' CUDA kernels);
  2. the runtime on CUDA + NCCL: the parity suite, the GPT parity check, the tensor-subclass
     recipes (torchao's int8, float8 with float8 all-gather, NF4) against torch's fully_shard and
     CommPolicy int8 both ways against the exact run, at world 1 and 2
     (tests/ops/test_cuda_runtime.py; 4 GPUs add HSDP and reshard_after_forward=2), and steady-state
     steps under torch.cuda.set_sync_debug_mode("error"): no host sync in forward and backward;
  3. the same with every side stream held up before each collective
     (FSDP_EXT_SIDE_STREAM_DELAY_CYCLES), so a missing wait or an early free shows as a wrong
     result instead of hiding behind fast collectives;
  4. the main job under torchrun with NCCL at world 1 and 2 (examples/train.py, a few steps,
     profiled: per-rank Chrome traces with the side streams' collectives beside the compute
     stream, and the timeline picture, under out/gpu_check/);
  5. the benchmarks' GPU tables: step time and peak memory against DDP / torch FSDP1 / FSDP2
     (python -m benchmarks.step.bench_step), the kernels (python -m
     benchmarks.kernels.bench_kernels --device cuda), and the step time with the collective tags
     on the device, checked on the host per collective, and off.

    python tools/gpu_check.py [--skip-benchmarks]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DELAY_CYCLES = "20000000"  # ~10 ms at 2 GHz per collective: far longer than any kernel here


def run(title: str, command: list[str], env: dict | None = None) -> bool:
    print(f"=== {title}\n$ {' '.join(command)}", flush=True)
    start = time.time()
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, **(env or {})})
    ok = result.returncode == 0
    print(f"=== {title}: {'ok' if ok else 'FAILED'} in {time.time() - start:.0f}s", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-benchmarks", action="store_true")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print("gpu-check: no CUDA GPU on this machine; nothing was tested (the CPU suite, "
              "`make test` and `make stream-check`, is what ran here)")
        return 0
    python, torchrun = sys.executable, os.path.join(os.path.dirname(sys.executable), "torchrun")
    no_interpret = {"TRITON_INTERPRET": "0"}
    steps = [
        ("kernels on the device", [python, "-m", "pytest", "-q", "tests/ops/test_ops_cuda.py",
                                   "tests/ops/test_ops_triton.py", "tests/ops/test_ops_quantized.py"],
         no_interpret),
        ("runtime on CUDA + NCCL", [python, "-m", "pytest", "-q", "tests/ops/test_cuda_runtime.py"],
         None),
        ("runtime with delayed side streams", [python, "-m", "pytest", "-q",
                                               "tests/ops/test_cuda_runtime.py"],
         {"FSDP_EXT_SIDE_STREAM_DELAY_CYCLES": DELAY_CYCLES}),
    ]
    for world in sorted({1, min(gpus, 2)}):
        steps.append((f"main job, NCCL world {world}",
                      [torchrun, "--standalone", f"--nproc-per-node={world}", "examples/train.py",
                       "--steps", "20", "--profile", "--out-dir", f"out/gpu_check/train_w{world}"],
                      None))
    if not args.skip_benchmarks:
        steps += [
            ("step time and memory vs DDP / FSDP1 / FSDP2",
             [python, "-m", "benchmarks.step.bench_step", "--world-size", str(min(gpus, 2)),
              "--steps", "10"], None),
            ("kernels", [python, "-m", "benchmarks.kernels.bench_kernels", "--device", "cuda"],
             None),
            ("collective tags: on device (default) / host check per collective / off",
             [python, "-m", "benchmarks.step.bench_step", "--world-size", str(min(gpus, 2)),
              "--steps", "12", "--frameworks", "fsdp_ext", "fsdp_ext-sync-tags",
              "fsdp_ext-unchecked", "local", "--no-plan", "--name",
              f"check_tags_gpu_w{min(gpus, 2)}"], None),
        ]
    failed = [title for title, command, env in steps if not run(title, command, env)]
    print(f"gpu-check on {gpus} GPU(s) ({torch.cuda.get_device_name(0)}): "
          + (f"FAILED: {', '.join(failed)}" if failed else "every step passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
