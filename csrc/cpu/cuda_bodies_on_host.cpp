// The ops computed by the CUDA kernels' own bodies (kernel_bodies.h, quant_warp_bodies.h), on CPU
// tensors: the same argument checks, run planning and run table as csrc/cuda/*.cu's host side,
// then every block and every thread (lane) of the grid, one after another. Exposed on fsdp_ext._C
// as cuda_bodies_{pack,unpack,cast_into_slot,grad_epilogue,quantize_into,dequantize_from,
// dequantize_sum} for tests/test_ops_cuda_bodies.py, so the arithmetic, the packet alignment
// logic and the jagged-grid lookup the GPU runs are tested here.
#include "../checks.h"
#include "../cuda_bodies_on_host.h"
#include "../flat_plan.h"
#include "../kernel_bodies.h"
#include "../quant_checks.h"
#include "../quant_warp_bodies.h"

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
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

// quantize_kernel (csrc/cuda/quantize.cu) for every warp: each lane's partial amax, merged over
// the lanes as the shuffles do, then each lane's codes.
void quantize_into_on_host(const at::Tensor& src, const at::Tensor& slot, const at::Tensor& starts,
                           bool fp8) {
  check_quantize_into_args(src, slot, starts);
  check_cpu(slot, "slot");
  const int64_t n = src.numel(), nblocks = starts.numel();
  if (n == 0) return;
  const int64_t* first_of = starts.const_data_ptr<int64_t>();
  uint8_t* out = slot.mutable_data_ptr<uint8_t>();
  with_element_type(dtype_code(src.scalar_type()), [&](auto src_type) {
    using S = decltype(src_type);
    const auto* src_values = static_cast<const typename S::storage*>(src.const_data_ptr());
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t first = first_of[b];
      const int64_t count = block_end(first_of, nblocks, n, b) - first;
      const typename S::storage* values = src_values + first;
      uint8_t* codes = out + first;
      const int64_t head = quant_head(values, codes, count);
      BlockAmax block = amax_start();
      for (int lane = 0; lane < kQuantLanes; ++lane) {
        block = amax_merge(block, lane_amax<S>(values, count, head, lane, kQuantLanes));
      }
      const float scale = fp8 ? block_scale<true>(block) : block_scale<false>(block);
      std::memcpy(out + align16(n) + 4 * b, &scale, sizeof(scale));
      for (int lane = 0; lane < kQuantLanes; ++lane) {
        if (fp8) {
          lane_codes<S, true>(values, codes, count, head, scale, lane, kQuantLanes);
        } else {
          lane_codes<S, false>(values, codes, count, head, scale, lane, kQuantLanes);
        }
      }
    }
  });
}

// dequantize_kernel for every warp and lane: one slot (world 1, kSum false) or a sum.
template <bool kSum>
void dequantize_on_host(const at::Tensor& wire, const at::Tensor& out, const at::Tensor& starts,
                        int64_t world, int64_t stride, bool fp8) {
  check_cpu(wire, "wire");
  const int64_t n = out.numel(), nblocks = starts.numel();
  if (n == 0) return;
  const uint8_t* in = wire.const_data_ptr<uint8_t>();
  with_element_type(dtype_code(out.scalar_type()), [&](auto dst_type) {
    using D = decltype(dst_type);
    auto* values = static_cast<typename D::storage*>(out.mutable_data_ptr());
    for (int64_t b = 0; b < nblocks; ++b) {
      for (int lane = 0; lane < kQuantLanes; ++lane) {
        if (fp8) {
          lane_dequantize<D, true, kSum>(in, values, n, starts.const_data_ptr<int64_t>(), nblocks,
                                         world, stride, b, lane, kQuantLanes);
        } else {
          lane_dequantize<D, false, kSum>(in, values, n, starts.const_data_ptr<int64_t>(),
                                          nblocks, world, stride, b, lane, kQuantLanes);
        }
      }
    }
  });
}

void dequantize_from_on_host(const at::Tensor& slot, const at::Tensor& out,
                             const at::Tensor& starts, bool fp8) {
  check_dequantize_from_args(slot, out, starts);
  dequantize_on_host<false>(slot, out, starts, 1, 0, fp8);
}

void dequantize_sum_on_host(const at::Tensor& wire, const at::Tensor& out,
                            const at::Tensor& starts, int64_t world, int64_t stride, bool fp8) {
  check_dequantize_sum_args(wire, out, starts, world, stride);
  dequantize_on_host<true>(wire, out, starts, world, stride, fp8);
}

}  // namespace

void register_cuda_bodies_on_host(pybind11::module_& module) {
  module.def("cuda_bodies_pack", &pack_on_host);
  module.def("cuda_bodies_unpack", &unpack_on_host);
  module.def("cuda_bodies_cast_into_slot", &cast_into_slot_on_host);
  module.def("cuda_bodies_grad_epilogue", &grad_epilogue_on_host);
  module.def("cuda_bodies_quantize_into", &quantize_into_on_host);
  module.def("cuda_bodies_dequantize_from", &dequantize_from_on_host);
  module.def("cuda_bodies_dequantize_sum", &dequantize_sum_on_host);
}

}  // namespace fsdp_ext
