// CUDA kernels of the block-quantized collectives (schemas in csrc/ops.cpp; semantics in
// fsdp_ext/ops/reference.py). One warp per quantization block, eight blocks per CUDA block: the
// lanes read the block's values 16 bytes each side by side, reduce its amax with __shfl_xor_sync,
// then read them again (from cache) and write the codes; dequantize reads 4 or 8 code bytes a lane
// and writes 16 bytes of values. The lane bodies are csrc/quant_warp_bodies.h, which the CPU tests
// run lane by lane on the host (cuda_bodies_on_host.cpp), with the per-element arithmetic of
// csrc/quant_bodies.h, the CPU kernels' own. All on the current stream; nothing waits on the host.
#include "../flat_plan.h"
#include "../quant_checks.h"
#include "../quant_warp_bodies.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

namespace fsdp_ext {
namespace {

constexpr int kThreads = kQuantLanes * kQuantBlocksPerCta;

// CUDA blocks for nblocks quantization blocks (at least one: the grid must not be empty).
unsigned grid_for(int64_t nblocks) {
  return static_cast<unsigned>((nblocks + kQuantBlocksPerCta - 1) / kQuantBlocksPerCta);
}

// The quantization block of this warp (the same for all its lanes, so whole warps return early
// and the shuffles below always have all 32 lanes), and this thread's lane.
__device__ __forceinline__ int64_t warp_block() {
  return static_cast<int64_t>(blockIdx.x) * kQuantBlocksPerCta + threadIdx.x / kQuantLanes;
}
__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x % kQuantLanes); }

// The block's amax over all lanes, in every lane (max and `and` give the same result in any
// order of merging: quant_bodies.h, BlockAmax).
__device__ __forceinline__ BlockAmax warp_amax(BlockAmax part) {
#pragma unroll
  for (int offset = kQuantLanes / 2; offset > 0; offset /= 2) {
    const BlockAmax other{__shfl_xor_sync(0xffffffffu, part.amax, offset),
                          __shfl_xor_sync(0xffffffffu, part.finite, offset)};
    part = amax_merge(part, other);
  }
  return part;
}

template <class S, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const typename S::storage* __restrict__ src, int64_t n,
                    const int64_t* __restrict__ starts, int64_t nblocks, uint8_t* slot) {
  const int64_t b = warp_block();
  if (b >= nblocks) return;
  const int lane = lane_id();
  const int64_t first = starts[b];
  const int64_t count = block_end(starts, nblocks, n, b) - first;
  const typename S::storage* values = src + first;
  uint8_t* codes = slot + first;
  const int64_t head = quant_head(values, codes, count);
  const float scale = block_scale<kFp8>(warp_amax(lane_amax<S>(values, count, head, lane,
                                                               kQuantLanes)));
  if (lane == 0) memcpy(slot + align16(n) + 4 * b, &scale, sizeof(scale));
  lane_codes<S, kFp8>(values, codes, count, head, scale, lane, kQuantLanes);
}

template <class D, bool kFp8, bool kSum>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ wire, typename D::storage* out, int64_t n,
                      const int64_t* __restrict__ starts, int64_t nblocks, int64_t world,
                      int64_t stride) {
  const int64_t b = warp_block();
  if (b >= nblocks) return;
  lane_dequantize<D, kFp8, kSum>(wire, out, n, starts, nblocks, world, stride, b, lane_id(),
                                 kQuantLanes);
}

void quantize_into_cuda(const at::Tensor& src, const at::Tensor& slot, const at::Tensor& starts,
                        bool fp8) {
  check_quantize_into_args(src, slot, starts);
  const int64_t n = src.numel(), nblocks = starts.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(slot.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_element_type(dtype_code(src.scalar_type()), [&](auto src_type) {
    using S = decltype(src_type);
    const auto* values = static_cast<const typename S::storage*>(src.data_ptr());
    if (fp8) {
      quantize_kernel<S, true><<<grid_for(nblocks), kThreads, 0, stream>>>(
          values, n, starts.data_ptr<int64_t>(), nblocks, slot.data_ptr<uint8_t>());
    } else {
      quantize_kernel<S, false><<<grid_for(nblocks), kThreads, 0, stream>>>(
          values, n, starts.data_ptr<int64_t>(), nblocks, slot.data_ptr<uint8_t>());
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kSum>
void dequantize_cuda(const at::Tensor& wire, const at::Tensor& out, const at::Tensor& starts,
                     int64_t world, int64_t stride, bool fp8) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(wire.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_element_type(dtype_code(out.scalar_type()), [&](auto dst_type) {
    using D = decltype(dst_type);
    auto* values = static_cast<typename D::storage*>(out.data_ptr());
    if (fp8) {
      dequantize_kernel<D, true, kSum><<<grid_for(starts.numel()), kThreads, 0, stream>>>(
          wire.data_ptr<uint8_t>(), values, n, starts.data_ptr<int64_t>(), starts.numel(),
          world, stride);
    } else {
      dequantize_kernel<D, false, kSum><<<grid_for(starts.numel()), kThreads, 0, stream>>>(
          wire.data_ptr<uint8_t>(), values, n, starts.data_ptr<int64_t>(), starts.numel(),
          world, stride);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_from_cuda(const at::Tensor& slot, const at::Tensor& out, const at::Tensor& starts,
                          bool fp8) {
  check_dequantize_from_args(slot, out, starts);
  dequantize_cuda<false>(slot, out, starts, 1, 0, fp8);
}

void dequantize_sum_cuda(const at::Tensor& wire, const at::Tensor& out, const at::Tensor& starts,
                         int64_t world, int64_t stride, bool fp8) {
  check_dequantize_sum_args(wire, out, starts, world, stride);
  dequantize_cuda<true>(wire, out, starts, world, stride, fp8);
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdp_ext, CUDA, m) {
  m.impl("quantize_into", &quantize_into_cuda);
  m.impl("dequantize_from", &dequantize_from_cuda);
  m.impl("dequantize_sum", &dequantize_sum_cuda);
}

}  // namespace fsdp_ext
