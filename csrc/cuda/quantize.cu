// CUDA kernels of the block-quantized collectives (schemas in csrc/ops.cpp; semantics in
// fsdp_ext/ops/reference.py). The per-block and per-value bodies are csrc/quant_bodies.h, the
// same code the CPU kernels (csrc/cpu/quantize.cpp) run, so the CPU tests check these values.
// quantize: one thread per block (it reads its block twice: amax, then codes); dequantize: one
// thread per value, which finds its block by binary search over `starts` (a device tensor the
// runtime makes once per bucket). All on the current stream; nothing waits on the host.
#include "../flat_plan.h"
#include "../quant_checks.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

namespace fsdp_ext {
namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t items) { return static_cast<unsigned>((items + kThreads - 1) / kThreads); }

template <class S, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const typename S::storage* __restrict__ src, int64_t n,
                    const int64_t* __restrict__ starts, int64_t nblocks, uint8_t* slot) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < nblocks) quantize_block<S, kFp8>(src, n, starts, nblocks, b, slot);
}

template <class D, bool kFp8, bool kSum>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ wire, typename D::storage* out, int64_t n,
                      const int64_t* __restrict__ starts, int64_t nblocks, int64_t world,
                      int64_t stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t b = find_segment(starts, nblocks, i);
  if constexpr (kSum) {
    float total = 0.0f;
    for (int64_t r = 0; r < world; ++r) {
      total = add_rn(total, dequantized_value<kFp8>(wire + r * stride, n, b, i));
    }
    out[i] = D::from_float(total);
  } else {
    out[i] = D::from_float(dequantized_value<kFp8>(wire, n, b, i));
  }
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
      dequantize_kernel<D, true, kSum><<<grid_for(n), kThreads, 0, stream>>>(
          wire.data_ptr<uint8_t>(), values, n, starts.data_ptr<int64_t>(), starts.numel(),
          world, stride);
    } else {
      dequantize_kernel<D, false, kSum><<<grid_for(n), kThreads, 0, stream>>>(
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
