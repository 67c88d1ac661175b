// The four ops computed by the CUDA kernels' own bodies (kernel_bodies.h), on CPU tensors: the
// same argument checks, run planning and run table as csrc/cuda/flat_param.cu's host side, then
// every block and every thread of the grid, one after another. Exposed on fsdp_ext._C as
// cuda_bodies_{pack,unpack,cast_into_slot,grad_epilogue} for tests/test_ops_cuda_bodies.py, so the
// arithmetic, the packet alignment logic and the jagged-grid lookup the GPU runs are tested here.
#include "../checks.h"
#include "../cuda_bodies_on_host.h"
#include "../flat_plan.h"
#include "../kernel_bodies.h"

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace fsdp_ext {
namespace {

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "cuda_bodies: ", name, " must be a CPU tensor");
}

// Every thread of every block, as the launch grid would run them.
template <class Body>
void run_grid(int64_t blocks, Body&& body) {
  for (int64_t block = 0; block < blocks; ++block) {
    for (int thread = 0; thread < kThreadsPerBlock; ++thread) body(block, thread);
  }
}

template <bool kPack>
void run_flat_runs(const std::vector<FlatRun>& runs, const at::Tensor& flat, float scale,
                   bool scaled) {
  if (runs.empty()) return;
  std::vector<int64_t> table(5 * runs.size());
  const int64_t blocks = fill_run_table(runs, table.data());
  char* data = static_cast<char*>(flat.data_ptr());
  const int64_t flat_dtype = dtype_code(flat.scalar_type());
  run_grid(blocks, [&](int64_t block, int thread) {
    flat_runs_block<kPack>(table.data(), static_cast<int64_t>(runs.size()), data, flat_dtype, scale,
                           scaled, block, thread, kThreadsPerBlock);
  });
}

void pack_on_host(const std::vector<at::Tensor>& srcs, std::vector<int64_t> offsets,
                  const at::Tensor& out, int64_t out_offset, double scale) {
  check_pack_args(at::TensorList(srcs), offsets, out, out_offset);
  check_cpu(out, "out");
  run_flat_runs<true>(plan_runs(at::TensorList(srcs), offsets, out_offset, out.numel(), true), out,
                      static_cast<float>(scale), scale != 1.0);
}

void unpack_on_host(const at::Tensor& src, int64_t src_offset, std::vector<int64_t> offsets,
                    const std::vector<at::Tensor>& outs) {
  check_unpack_args(src, src_offset, offsets, at::TensorList(outs));
  check_cpu(src, "src");
  run_flat_runs<false>(plan_runs(at::TensorList(outs), offsets, src_offset, src.numel(), false),
                       src, 1.0f, false);
}

void cast_into_slot_on_host(const at::Tensor& shard, const at::Tensor& gathered, int64_t slot) {
  check_cast_into_slot_args(shard, gathered, slot);
  check_cpu(gathered, "gathered");
  const int64_t n = shard.numel();
  if (n == 0) return;
  with_element_type(dtype_code(shard.scalar_type()), [&](auto src_type) {
    with_element_type(dtype_code(gathered.scalar_type()), [&](auto dst_type) {
      using S = decltype(src_type);
      using D = decltype(dst_type);
      const auto* src = static_cast<const typename S::storage*>(shard.data_ptr());
      auto* dst = static_cast<typename D::storage*>(gathered.data_ptr()) + slot * n;
      run_grid(blocks_for(n), [&](int64_t block, int thread) {
        cast_block<S, D>(src, dst, n, block, thread, kThreadsPerBlock);
      });
    });
  });
}

void grad_epilogue_on_host(const at::Tensor& reduced, const at::Tensor& out, double divisor,
                           bool accumulate) {
  check_grad_epilogue_args(reduced, out);
  check_cpu(out, "out");
  const int64_t n = out.numel();
  if (n == 0) return;
  const EpilogueDivide divide = epilogue_divide(divisor);
  with_element_type(dtype_code(reduced.scalar_type()), [&](auto src_type) {
    with_element_type(dtype_code(out.scalar_type()), [&](auto dst_type) {
      using S = decltype(src_type);
      using D = decltype(dst_type);
      const auto* in = static_cast<const typename S::storage*>(reduced.data_ptr());
      auto* dst = static_cast<typename D::storage*>(out.data_ptr());
      run_grid(blocks_for(n), [&](int64_t block, int thread) {
        epilogue_block<S, D>(in, dst, n, divide.factor, divide.mode, accumulate, block, thread,
                             kThreadsPerBlock);
      });
    });
  });
}

}  // namespace

void register_cuda_bodies_on_host(pybind11::module_& module) {
  module.def("cuda_bodies_pack", &pack_on_host);
  module.def("cuda_bodies_unpack", &unpack_on_host);
  module.def("cuda_bodies_cast_into_slot", &cast_into_slot_on_host);
  module.def("cuda_bodies_grad_epilogue", &grad_epilogue_on_host);
}

}  // namespace fsdp_ext
