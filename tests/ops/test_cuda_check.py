"""tools/cuda_check.py (`make cuda-check`) fails on a kernel that spills registers or uses local
memory, naming it: planted kernels, compiled for sm_80 and sm_90 with nvcc (no GPU needed, no
torch headers: about 5 s). Skipped where there is no nvcc."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")

KERNELS = {
    # 48 live values against the 32 registers a thread gets at 1024 threads x 2 blocks.
    "spills.cu": """
__global__ void __launch_bounds__(1024, 2) planted_spill(const float* in, float* out) {
  float v[48];
#pragma unroll
  for (int i = 0; i < 48; ++i) v[i] = in[i * blockDim.x + threadIdx.x];
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 48; ++i) s += v[i] * v[47 - i] / (v[(i + 5) % 48] + 1.0f);
  out[threadIdx.x] = s;
}
""",
    # Indexed with a runtime value, the running sums live in a stack frame (no spill).
    "local_array.cu": """
__global__ void planted_local_array(const float* in, const int* index, float* out) {
  float sums[256];
  float total = 0.0f;
  for (int i = 0; i < 256; ++i) sums[i] = total += in[i * blockDim.x + threadIdx.x];
  out[threadIdx.x] = sums[index[threadIdx.x] & 255];
}
""",
    "clean.cu": """
__global__ void clean_scale(const float* in, float* out, float scale, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] * scale;
}
""",
}


@pytest.mark.skipif(not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")),
                    reason=f"no nvcc under {CUDA_HOME} (set CUDA_HOME)")
def test_cuda_check_fails_on_spills_and_local_memory(tmp_path):
    for name, source in KERNELS.items():
        (tmp_path / name).write_text(source)
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "cuda_check.py"), "--arch", "8.0;9.0",
         *(str(tmp_path / name) for name in KERNELS)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_HOME": CUDA_HOME})
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "spills.cu [8.0;9.0] FAILED" in out and "local_array.cu [8.0;9.0] FAILED" in out, out
    assert "clean.cu [8.0;9.0] ok" in out, out
    # Named demangled where c++filt is installed, with ptxas's counts.
    assert "Registers are spilled to local memory in function 'planted_spill" in out, out
    assert "bytes spill stores" in out, out
    assert "Local memory used for function 'planted_local_array" in out, out
    assert "size of stack frame: 1024 bytes" in out, out
