// CUDA kernels of the block-quantized collectives (schemas in csrc/ops.cpp; semantics in
// fsdp_ext/ops/reference.py). The per-block and per-value bodies are csrc/quant_bodies.h, the
// same code the CPU kernels (csrc/cpu/quantize.cpp) run, so the CPU tests check these values.
// quantize: one thread per quantization block (it reads its block twice: amax, then codes);
// dequantize: one thread per value. All on the current stream; nothing waits on the host.
#include "../checks.h"
#include "../flat_plan.h"
#include "../quant_bodies.h"

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
    quantize_kernel(const typename S::storage* __restrict__ src, int64_t n, int64_t block,
                    uint8_t* slot) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < quant_blocks(n, block)) quantize_block<S, kFp8>(src, n, block, b, slot);
}

template <class D, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    dequantize_slots_kernel(const uint8_t* __restrict__ wire, typename D::storage* out, int64_t n,
                            int64_t total, int64_t block) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= total) return;
  const int64_t r = j / n;
  out[j] = D::from_float(
      dequantized_value<kFp8>(wire + r * quant_slot_bytes(n, block), n, block, j - r * n));
}

template <class D, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    dequantize_sum_kernel(const uint8_t* __restrict__ wire, typename D::storage* out, int64_t n,
                          int64_t world, int64_t block) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float total = 0.0f;
  for (int64_t r = 0; r < world; ++r) {
    total = add_rn(total, dequantized_value<kFp8>(wire + r * quant_slot_bytes(n, block), n,
                                                  block, i));
  }
  out[i] = D::from_float(total);
}

void check_wire(const at::Tensor& wire, int64_t n, int64_t slots, int64_t block) {
  FSDP_EXT_CHECK(wire.is_cuda() && wire.scalar_type() == at::kByte && wire.dim() == 1 &&
                     wire.is_contiguous(),
                 "wire must be a contiguous 1-D uint8 CUDA tensor");
  FSDP_EXT_CHECK(block > 0 && block % 8 == 0, "block ", block, " is not a positive multiple of 8");
  FSDP_EXT_CHECK(wire.numel() >= slots * quant_slot_bytes(n, block), "wire has ", wire.numel(),
                 " bytes; ", slots, " slot(s) of ", n, " values need ",
                 slots * quant_slot_bytes(n, block));
}

void quantize_into_slot_cuda(const at::Tensor& src, const at::Tensor& wire, int64_t slot,
                             int64_t block, bool fp8) {
  CHECK_TENSOR(src, "src", wire.device());
  const int64_t n = src.numel();
  CHECK_NON_NEGATIVE(slot, "slot");
  check_wire(wire, n, slot + 1, block);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(wire.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  uint8_t* out = wire.data_ptr<uint8_t>() + slot * quant_slot_bytes(n, block);
  with_element_type(dtype_code(src.scalar_type()), [&](auto src_type) {
    using S = decltype(src_type);
    const auto* values = static_cast<const typename S::storage*>(src.data_ptr());
    const unsigned grid = grid_for(quant_blocks(n, block));
    if (fp8) {
      quantize_kernel<S, true><<<grid, kThreads, 0, stream>>>(values, n, block, out);
    } else {
      quantize_kernel<S, false><<<grid, kThreads, 0, stream>>>(values, n, block, out);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_slots_cuda(const at::Tensor& wire, const at::Tensor& out, int64_t world,
                           int64_t block, bool fp8) {
  CHECK_TENSOR(out, "out", wire.device());
  FSDP_EXT_CHECK(world > 0 && out.numel() % world == 0, "out has ", out.numel(),
                 " values, not a multiple of world ", world);
  const int64_t n = out.numel() / world;
  check_wire(wire, n, world, block);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(wire.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_element_type(dtype_code(out.scalar_type()), [&](auto dst_type) {
    using D = decltype(dst_type);
    auto* values = static_cast<typename D::storage*>(out.data_ptr());
    const unsigned grid = grid_for(out.numel());
    if (fp8) {
      dequantize_slots_kernel<D, true><<<grid, kThreads, 0, stream>>>(
          wire.data_ptr<uint8_t>(), values, n, out.numel(), block);
    } else {
      dequantize_slots_kernel<D, false><<<grid, kThreads, 0, stream>>>(
          wire.data_ptr<uint8_t>(), values, n, out.numel(), block);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_sum_cuda(const at::Tensor& wire, const at::Tensor& out, int64_t world,
                         int64_t block, bool fp8) {
  CHECK_TENSOR(out, "out", wire.device());
  const int64_t n = out.numel();
  check_wire(wire, n, world, block);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(wire.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_element_type(dtype_code(out.scalar_type()), [&](auto dst_type) {
    using D = decltype(dst_type);
    auto* values = static_cast<typename D::storage*>(out.data_ptr());
    if (fp8) {
      dequantize_sum_kernel<D, true><<<grid_for(n), kThreads, 0, stream>>>(
          wire.data_ptr<uint8_t>(), values, n, world, block);
    } else {
      dequantize_sum_kernel<D, false><<<grid_for(n), kThreads, 0, stream>>>(
          wire.data_ptr<uint8_t>(), values, n, world, block);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdp_ext, CUDA, m) {
  m.impl("quantize_into_slot", &quantize_into_slot_cuda);
  m.impl("dequantize_slots", &dequantize_slots_cuda);
  m.impl("dequantize_sum", &dequantize_sum_cuda);
}

}  // namespace fsdp_ext
