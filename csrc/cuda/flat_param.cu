// CUDA kernels for the four ops (schemas in csrc/ops.cpp, semantics in fsdp_ext/ops/reference.py).
// What each thread does is kernel_bodies.h, which the CPU tests also run (on the host, over the
// whole grid); this file holds the launches and the host side.
//
// pack/unpack: one launch for any number of tensors. The host plan (flat_plan.h) lists the runs of
// the window; each run gets ceil(length / kElementsPerBlock) blocks of a jagged grid, and a block
// finds its run by binary search over the runs' first block (flat_layout.h's find_segment). The
// table travels as one int64 tensor, copied host->device from pinned memory without blocking the
// host, then the kernel runs; both on the current stream (c10::cuda::getCurrentCUDAStream, which
// at::cuda re-exports), as in ATen's split_with_sizes_copy fast path. The arithmetic is
// flat_layout.h's, shared with the CPU kernels, so CPU tests cover the values the GPU computes.
#include "../checks.h"
#include "../flat_layout.h"
#include "../flat_plan.h"
#include "../kernel_bodies.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that pulls in cuBLAS/cuSPARSE
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace fsdp_ext {
namespace {

// The kernels: each thread runs its body from kernel_bodies.h (shared with the host tests).
template <bool kPack>
__global__ void __launch_bounds__(kThreadsPerBlock)
    flat_runs_kernel(const int64_t* __restrict__ table, int64_t num_runs, char* flat,
                     int64_t flat_dtype, float scale, bool scaled) {
  flat_runs_block<kPack>(table, num_runs, flat, flat_dtype, scale, scaled, blockIdx.x, threadIdx.x,
                         blockDim.x);
}

template <class Src, class Dst>
__global__ void __launch_bounds__(kThreadsPerBlock)
    cast_kernel(const typename Src::storage* src, typename Dst::storage* dst, int64_t n) {
  cast_block<Src, Dst>(src, dst, n, blockIdx.x, threadIdx.x, blockDim.x);
}

template <class Src, class Dst>
__global__ void __launch_bounds__(kThreadsPerBlock)
    epilogue_kernel(const typename Src::storage* reduced, typename Dst::storage* out, int64_t n,
                    float factor, int mode, bool accumulate) {
  epilogue_block<Src, Dst>(reduced, out, n, factor, mode, accumulate, blockIdx.x, threadIdx.x,
                           blockDim.x);
}

// Copies the run table to `device`; returns it and sets *total_blocks to the grid size.
at::Tensor upload_runs(const std::vector<FlatRun>& runs, const c10::Device& device,
                       int64_t* total_blocks) {
  const int64_t count = static_cast<int64_t>(runs.size());
  at::Tensor host = at::empty({5 * count}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  *total_blocks = fill_run_table(runs, host.data_ptr<int64_t>());
  // The caching host allocator keeps `host` alive until this copy has run on the stream.
  return host.to(device, at::kLong, /*non_blocking=*/true);
}

// flat: the 1-D window tensor; runs: its plan. One launch on the current stream.
void launch_runs(const std::vector<FlatRun>& runs, const at::Tensor& flat, bool pack, float scale,
                 bool scaled) {
  if (runs.empty()) return;
  int64_t blocks = 0;
  const at::Tensor table = upload_runs(runs, flat.device(), &blocks);
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "fsdp_ext: window too large");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto kernel = pack ? flat_runs_kernel<true> : flat_runs_kernel<false>;
  kernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(
      table.data_ptr<int64_t>(), static_cast<int64_t>(runs.size()),
      static_cast<char*>(flat.data_ptr()), dtype_code(flat.scalar_type()), scale, scaled);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// srcs: list of tensors (any shapes); out: [window numel], window at out_offset of the flat space.
void pack_cuda(at::TensorList srcs, at::IntArrayRef offsets, const at::Tensor& out,
               int64_t out_offset, double scale) {
  check_pack_args(srcs, offsets, out, out_offset);
  const c10::cuda::CUDAGuard guard(out.device());
  launch_runs(plan_runs(srcs, offsets, out_offset, out.numel(), true), out, true,
              static_cast<float>(scale), scale != 1.0);
}

// src: [window numel], window at src_offset of the flat space; outs: list of tensors (any shapes).
void unpack_cuda(const at::Tensor& src, int64_t src_offset, at::IntArrayRef offsets,
                 at::TensorList outs) {
  check_unpack_args(src, src_offset, offsets, outs);
  const c10::cuda::CUDAGuard guard(src.device());
  launch_runs(plan_runs(outs, offsets, src_offset, src.numel(), false), src, false, 1.0f, false);
}

// shard: any shape, n elements; gathered: [>= (slot + 1) * n]; writes gathered[slot*n, (slot+1)*n).
void cast_into_slot_cuda(const at::Tensor& shard, const at::Tensor& gathered, int64_t slot) {
  check_cast_into_slot_args(shard, gathered, slot);
  const int64_t n = shard.numel();
  if (n == 0) return;
  TORCH_CHECK(blocks_for(n) <= std::numeric_limits<int32_t>::max(), "fsdp_ext: shard too large");
  const c10::cuda::CUDAGuard guard(gathered.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_element_type(dtype_code(shard.scalar_type()), [&](auto src_type) {
    with_element_type(dtype_code(gathered.scalar_type()), [&](auto dst_type) {
      using S = decltype(src_type);
      using D = decltype(dst_type);
      cast_kernel<S, D><<<static_cast<unsigned>(blocks_for(n)), kThreadsPerBlock, 0, stream>>>(
          static_cast<const typename S::storage*>(shard.data_ptr()),
          static_cast<typename D::storage*>(gathered.data_ptr()) + slot * n, n);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// reduced: any shape, n elements; out: any shape, n elements (updated in place).
void grad_epilogue_cuda(const at::Tensor& reduced, const at::Tensor& out, double divisor,
                        bool accumulate) {
  check_grad_epilogue_args(reduced, out);
  const int64_t n = out.numel();
  if (n == 0) return;
  TORCH_CHECK(blocks_for(n) <= std::numeric_limits<int32_t>::max(), "fsdp_ext: out too large");
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const EpilogueDivide divide = epilogue_divide(divisor);
  with_element_type(dtype_code(reduced.scalar_type()), [&](auto src_type) {
    with_element_type(dtype_code(out.scalar_type()), [&](auto dst_type) {
      using S = decltype(src_type);
      using D = decltype(dst_type);
      epilogue_kernel<S, D><<<static_cast<unsigned>(blocks_for(n)), kThreadsPerBlock, 0, stream>>>(
          static_cast<const typename S::storage*>(reduced.data_ptr()),
          static_cast<typename D::storage*>(out.data_ptr()), n, divide.factor, divide.mode,
          accumulate);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdp_ext, CUDA, m) {
  m.impl("pack", &pack_cuda);
  m.impl("unpack", &unpack_cuda);
  m.impl("cast_into_slot", &cast_into_slot_cuda);
  m.impl("grad_epilogue", &grad_epilogue_cuda);
}

}  // namespace fsdp_ext
