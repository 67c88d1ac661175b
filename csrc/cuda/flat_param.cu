// CUDA kernels for the four ops (schemas in csrc/ops.cpp, semantics in fsdp_ext/ops/reference.py).
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

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kElementsPerBlock = 4096;  // 16 elements per thread: enough work per block

int64_t blocks_for(int64_t elements) { return (elements + kElementsPerBlock - 1) / kElementsPerBlock; }

// N elements moved as one 8- or 16-byte access.
template <class T, int N>
struct alignas(sizeof(T) * N) Packet {
  T v[N];
};

template <class T>
__device__ __forceinline__ int64_t elements_to_boundary(const T* p, uint64_t boundary_bytes) {
  const uint64_t address = reinterpret_cast<uint64_t>(p);
  return static_cast<int64_t>((boundary_bytes - address % boundary_bytes) % boundary_bytes /
                              sizeof(T));
}

// The block's threads write dst[0, n) = cast(src[0, n) * scale). Packets are used when src and dst
// reach a packet boundary after the same number of elements; otherwise everything is scalar.
template <class Src, class Dst>
__device__ void block_convert(const typename Src::storage* src, typename Dst::storage* dst,
                              int64_t n, float scale, bool scaled) {
  using S = typename Src::storage;
  using D = typename Dst::storage;
  constexpr int kVec = 16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
  int64_t head = elements_to_boundary(src, kVec * sizeof(S));
  if (head != elements_to_boundary(dst, kVec * sizeof(D)) || head > n) head = n;
  const int64_t packets = (n - head) / kVec;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) {
    dst[i] = convert_element<Src, Dst>(src[i], scale, scaled);
  }
  const auto* src_packets = reinterpret_cast<const Packet<S, kVec>*>(src + head);
  auto* dst_packets = reinterpret_cast<Packet<D, kVec>*>(dst + head);
  for (int64_t p = threadIdx.x; p < packets; p += blockDim.x) {
    const Packet<S, kVec> in = src_packets[p];
    Packet<D, kVec> out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) out.v[k] = convert_element<Src, Dst>(in.v[k], scale, scaled);
    dst_packets[p] = out;
  }
  for (int64_t i = head + packets * kVec + threadIdx.x; i < n; i += blockDim.x) {
    dst[i] = convert_element<Src, Dst>(src[i], scale, scaled);
  }
}

// The block's threads write dst[0, n) = +0 (all-zero bits in every dtype), 16 bytes at a time.
template <class Dst>
__device__ void block_zero(typename Dst::storage* dst, int64_t n) {
  using D = typename Dst::storage;
  constexpr int kVec = 16 / sizeof(D);
  const int64_t head = min(n, elements_to_boundary(dst, 16));
  const int64_t packets = (n - head) / kVec;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = D(0);
  auto* dst_packets = reinterpret_cast<Packet<D, kVec>*>(dst + head);
  const Packet<D, kVec> zeros = {};
  for (int64_t p = threadIdx.x; p < packets; p += blockDim.x) dst_packets[p] = zeros;
  for (int64_t i = head + packets * kVec + threadIdx.x; i < n; i += blockDim.x) dst[i] = D(0);
}

// Table of num_runs runs, five int64 columns one after another (filled by upload_runs):
//   first_block | window_begin | length | tensor_address | tensor_dtype
// kPack: tensors -> flat window (zero-fill runs write zeros); otherwise flat window -> tensors.
template <bool kPack>
__global__ void __launch_bounds__(kThreadsPerBlock)
    flat_runs_kernel(const int64_t* __restrict__ table, int64_t num_runs, char* flat,
                     int64_t flat_dtype, float scale, bool scaled) {
  const int64_t* first_block = table;
  const int64_t run = find_segment(first_block, num_runs, blockIdx.x);
  const int64_t window_begin = table[num_runs + run];
  const int64_t length = table[2 * num_runs + run];
  char* tensor = reinterpret_cast<char*>(table[3 * num_runs + run]);
  const int64_t tensor_dtype = table[4 * num_runs + run];

  const int64_t first = (static_cast<int64_t>(blockIdx.x) - first_block[run]) * kElementsPerBlock;
  const int64_t count = min(kElementsPerBlock, length - first);
  char* flat_at = flat + (window_begin + first) * element_size(flat_dtype);
  if (tensor_dtype == kZeroFill) {
    with_element_type(flat_dtype, [&](auto flat_type) {
      using F = decltype(flat_type);
      block_zero<F>(reinterpret_cast<typename F::storage*>(flat_at), count);
    });
    return;
  }
  char* tensor_at = tensor + first * element_size(tensor_dtype);
  char* src = kPack ? tensor_at : flat_at;
  char* dst = kPack ? flat_at : tensor_at;
  with_element_type(kPack ? tensor_dtype : flat_dtype, [&](auto src_type) {
    with_element_type(kPack ? flat_dtype : tensor_dtype, [&](auto dst_type) {
      using S = decltype(src_type);
      using D = decltype(dst_type);
      block_convert<S, D>(reinterpret_cast<const typename S::storage*>(src),
                          reinterpret_cast<typename D::storage*>(dst), count, scale, scaled);
    });
  });
}

// Copies the run table to `device`; returns it and sets *total_blocks to the grid size.
at::Tensor upload_runs(const std::vector<FlatRun>& runs, const c10::Device& device,
                       int64_t* total_blocks) {
  const int64_t count = static_cast<int64_t>(runs.size());
  at::Tensor host = at::empty({5 * count}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* columns = host.data_ptr<int64_t>();
  int64_t blocks = 0;
  for (int64_t i = 0; i < count; ++i) {
    columns[i] = blocks;
    columns[count + i] = runs[i].window_begin;
    columns[2 * count + i] = runs[i].length;
    columns[3 * count + i] = reinterpret_cast<int64_t>(runs[i].tensor_data);
    columns[4 * count + i] = runs[i].tensor_dtype;
    blocks += blocks_for(runs[i].length);
  }
  *total_blocks = blocks;
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

template <class Src, class Dst>
__global__ void __launch_bounds__(kThreadsPerBlock)
    cast_kernel(const typename Src::storage* src, typename Dst::storage* dst, int64_t n) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kElementsPerBlock;
  block_convert<Src, Dst>(src + first, dst + first, min(kElementsPerBlock, n - first), 1.0f, false);
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

template <class Src, class Dst>
__global__ void __launch_bounds__(kThreadsPerBlock)
    epilogue_kernel(const typename Src::storage* reduced, typename Dst::storage* out, int64_t n,
                    float scale, bool scaled, bool accumulate) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kElementsPerBlock;
  const int64_t end = min(first + kElementsPerBlock, n);
  for (int64_t i = first + threadIdx.x; i < end; i += blockDim.x) {
    out[i] = epilogue_element<Src, Dst>(reduced[i], out[i], scale, scaled, accumulate);
  }
}

// reduced: any shape, n elements; out: any shape, n elements (updated in place).
void grad_epilogue_cuda(const at::Tensor& reduced, const at::Tensor& out, double scale,
                        bool accumulate) {
  check_grad_epilogue_args(reduced, out);
  const int64_t n = out.numel();
  if (n == 0) return;
  TORCH_CHECK(blocks_for(n) <= std::numeric_limits<int32_t>::max(), "fsdp_ext: out too large");
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_element_type(dtype_code(reduced.scalar_type()), [&](auto src_type) {
    with_element_type(dtype_code(out.scalar_type()), [&](auto dst_type) {
      using S = decltype(src_type);
      using D = decltype(dst_type);
      epilogue_kernel<S, D><<<static_cast<unsigned>(blocks_for(n)), kThreadsPerBlock, 0, stream>>>(
          static_cast<const typename S::storage*>(reduced.data_ptr()),
          static_cast<typename D::storage*>(out.data_ptr()), n, static_cast<float>(scale),
          scale != 1.0, accumulate);
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
