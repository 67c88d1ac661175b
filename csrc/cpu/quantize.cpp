// CPU kernels of the block-quantized collectives (schemas in csrc/ops.cpp, bodies in
// csrc/quant_bodies.h, shared with the CUDA kernels; semantics in fsdp_ext/ops/reference.py).
// Work is split by blocks: a task quantizes, or dequantizes, whole blocks.
#include "../flat_plan.h"
#include "../quant_checks.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

namespace fsdp_ext {
namespace {

// Blocks per task: about 64K values, worth waking a thread for.
int64_t block_grain(int64_t n, int64_t nblocks) {
  const int64_t per_block = std::max<int64_t>(1, n / std::max<int64_t>(1, nblocks));
  return std::max<int64_t>(1, (int64_t{1} << 16) / per_block);
}

// src: n values (fp32/bf16/fp16) -> slot: codes and scales.
void quantize_into_cpu(const at::Tensor& src, const at::Tensor& slot, const at::Tensor& starts,
                       bool fp8) {
  check_quantize_into_args(src, slot, starts);
  const int64_t n = src.numel(), nblocks = starts.numel();
  if (n == 0) return;
  uint8_t* out = slot.mutable_data_ptr<uint8_t>();
  const int64_t* first = starts.const_data_ptr<int64_t>();
  with_element_type(dtype_code(src.scalar_type()), [&](auto src_type) {
    using S = decltype(src_type);
    const auto* values = static_cast<const typename S::storage*>(src.const_data_ptr());
    at::parallel_for(0, nblocks, block_grain(n, nblocks), [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        if (fp8) {
          quantize_block<S, true>(values, n, first, nblocks, b, out);
        } else {
          quantize_block<S, false>(values, n, first, nblocks, b, out);
        }
      }
    });
  });
}

// Blocks [lo, hi) dequantized into out: one slot's values (kSum false), or the sum over `world`
// slots `stride` bytes apart, from 0.0f in slot order (kSum true).
template <bool kFp8, bool kSum, class D>
void dequantize_blocks(const uint8_t* wire, typename D::storage* out, int64_t n,
                       const int64_t* starts, int64_t nblocks, int64_t world, int64_t stride,
                       int64_t lo, int64_t hi) {
  for (int64_t b = lo; b < hi; ++b) {
    const int64_t end = block_end(starts, nblocks, n, b);
    for (int64_t i = starts[b]; i < end; ++i) {
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
  }
}

template <bool kSum>
void dequantize_cpu(const at::Tensor& wire, const at::Tensor& out, const at::Tensor& starts,
                    int64_t world, int64_t stride, bool fp8) {
  const int64_t n = out.numel(), nblocks = starts.numel();
  if (n == 0) return;
  const uint8_t* in = wire.const_data_ptr<uint8_t>();
  const int64_t* first = starts.const_data_ptr<int64_t>();
  with_element_type(dtype_code(out.scalar_type()), [&](auto dst_type) {
    using D = decltype(dst_type);
    auto* values = static_cast<typename D::storage*>(out.mutable_data_ptr());
    at::parallel_for(0, nblocks, block_grain(n, nblocks), [&](int64_t lo, int64_t hi) {
      if (fp8) {
        dequantize_blocks<true, kSum, D>(in, values, n, first, nblocks, world, stride, lo, hi);
      } else {
        dequantize_blocks<false, kSum, D>(in, values, n, first, nblocks, world, stride, lo, hi);
      }
    });
  });
}

// slot: codes and scales of out.numel() values -> out.
void dequantize_from_cpu(const at::Tensor& slot, const at::Tensor& out, const at::Tensor& starts,
                         bool fp8) {
  check_dequantize_from_args(slot, out, starts);
  dequantize_cpu<false>(slot, out, starts, 1, 0, fp8);
}

// wire: `world` slots, `stride` bytes apart, of out.numel() values each -> out, their sum.
void dequantize_sum_cpu(const at::Tensor& wire, const at::Tensor& out, const at::Tensor& starts,
                        int64_t world, int64_t stride, bool fp8) {
  check_dequantize_sum_args(wire, out, starts, world, stride);
  dequantize_cpu<true>(wire, out, starts, world, stride, fp8);
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdp_ext, CPU, m) {
  m.impl("quantize_into", &quantize_into_cpu);
  m.impl("dequantize_from", &dequantize_from_cpu);
  m.impl("dequantize_sum", &dequantize_sum_cpu);
}

}  // namespace fsdp_ext
