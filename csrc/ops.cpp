// The op schemas (declared once, here) and the Python module shell fsdp_ext._C.
//
// Kernels register against these schemas in csrc/cpu/flat_param.cpp (CPU) and
// csrc/cuda/flat_param.cu (CUDA); the semantics are fsdp_ext/ops/reference.py, and the fake
// (meta) implementations used by torch.compile live in fsdp_ext/ops/fake.py.
#include "cpu_vector.h"
#include "cuda_bodies_on_host.h"
#include "issue_thread.h"
#include "storage_cache.h"

#include <pybind11/pybind11.h>
#include <torch/library.h>

TORCH_LIBRARY(fsdp_ext, m) {
  // Tracing an op that needs a fake implementation tells the user to import this module.
  m.set_python_module("fsdp_ext.ops.fake");
  // Window semantics: `out` holds the flat elements [out_offset, out_offset + out.numel()); every
  // element of the window is written, cast(src * scale) where a source covers it, else zero.
  m.def(
      "pack(Tensor[] srcs, int[] offsets, Tensor(a!) out, int out_offset=0, float scale=1.0) "
      "-> ()");
  // `src` holds the flat elements [src_offset, src_offset + src.numel()); only the parts of
  // `outs` inside that window are written.
  m.def("unpack(Tensor src, int src_offset, int[] offsets, Tensor(a!)[] outs) -> ()");
  // gathered[slot * n, (slot + 1) * n) = cast(shard), n = shard.numel(): the all-gather copy-in.
  m.def("cast_into_slot(Tensor shard, Tensor(a!) gathered, int slot) -> ()");
  // out = cast((out if accumulate else 0) + q), in fp32, q = reduced / divisor rounded to
  // reduced's dtype (as torch divides a reduced gradient): the gradient epilogue.
  m.def("grad_epilogue(Tensor reduced, Tensor(a!) out, float divisor, bool accumulate) -> ()");
  // Block-quantized collectives (CommPolicy): a slot of n values is n codes (int8, or
  // float8_e4m3fn with fp8=True) and one fp32 scale per block, block b starting at starts[b]
  // (reference.py).
  m.def("quantize_into(Tensor src, Tensor(a!) slot, Tensor starts, bool fp8) -> ()");
  m.def("dequantize_from(Tensor slot, Tensor(a!) out, Tensor starts, bool fp8) -> ()");
  m.def(
      "dequantize_sum(Tensor wire, Tensor(a!) out, Tensor starts, int world, int stride, "
      "bool fp8) -> ()");
}

// Importing fsdp_ext._C loads this library, which runs the registrations above; the module itself
// exposes the host storage cache (fsdp_ext/runtime/core/storage_cache.py), the CPU issue thread
// (fsdp_ext/runtime/comm/collectives.py) and, for the tests, the CUDA kernels' bodies run on the host and the
// CPU kernels' vector switch (cpu_vector.h).
PYBIND11_MODULE(_C, module) {
  module.doc() = "fsdp_ext compiled ops; use torch.ops.fsdp_ext.* (see fsdp_ext.ops)";
  fsdp_ext::register_storage_cache(module);
  fsdp_ext::register_issue_thread(module);
  fsdp_ext::register_cuda_bodies_on_host(module);
  fsdp_ext::register_cpu_vector(module);
}
