// CPU kernels of the block-quantized collectives (schemas in csrc/ops.cpp, bodies in
// csrc/quant_bodies.h, shared with the CUDA kernels; semantics in fsdp_ext/ops/reference.py).
// Work is split by blocks: a task quantizes, or dequantizes, whole blocks.
#include "../checks.h"
#include "../flat_plan.h"
#include "../quant_bodies.h"

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

void check_starts(const at::Tensor& starts, const at::Tensor& bytes, int64_t n) {
  FSDP_EXT_CHECK(starts.scalar_type() == at::kLong && starts.dim() == 1 &&
                     starts.is_contiguous() && starts.device() == bytes.device(),
                 "starts must be a contiguous 1-D int64 tensor on the bytes' device");
  FSDP_EXT_CHECK(n == 0 || starts.numel() > 0, "starts: n > 0 values need a block");
}

void check_bytes(const at::Tensor& bytes, const char* name, int64_t need) {
  FSDP_EXT_CHECK(bytes.scalar_type() == at::kByte && bytes.dim() == 1 && bytes.is_contiguous(),
                 name, " must be a contiguous 1-D uint8 tensor");
  FSDP_EXT_CHECK(bytes.numel() >= need, name, " has ", bytes.numel(), " bytes, needs ", need);
}

// src: n values (fp32/bf16/fp16) -> slot: codes and scales.
void quantize_into_cpu(const at::Tensor& src, const at::Tensor& slot, const at::Tensor& starts,
                       bool fp8) {
  CHECK_TENSOR(src, "src", slot.device());
  const int64_t n = src.numel(), nblocks = starts.numel();
  check_starts(starts, slot, n);
  check_bytes(slot, "slot", quant_slot_bytes(n, nblocks));
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
  CHECK_TENSOR(out, "out", slot.device());
  check_starts(starts, slot, out.numel());
  const int64_t need = quant_slot_bytes(out.numel(), starts.numel());
  check_bytes(slot, "slot", need);
  dequantize_cpu<false>(slot, out, starts, 1, need, fp8);
}

// wire: `world` slots, `stride` bytes apart, of out.numel() values each -> out, their sum.
void dequantize_sum_cpu(const at::Tensor& wire, const at::Tensor& out, const at::Tensor& starts,
                        int64_t world, int64_t stride, bool fp8) {
  CHECK_TENSOR(out, "out", wire.device());
  check_starts(starts, wire, out.numel());
  const int64_t need = quant_slot_bytes(out.numel(), starts.numel());
  FSDP_EXT_CHECK(world >= 1, "world must be >= 1");
  FSDP_EXT_CHECK(world == 1 || stride >= need, "stride ", stride, " is below a slot's ", need);
  check_bytes(wire, "wire", (world - 1) * stride + need);
  dequantize_cpu<true>(wire, out, starts, world, stride, fp8);
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdp_ext, CPU, m) {
  m.impl("quantize_into", &quantize_into_cpu);
  m.impl("dequantize_from", &dequantize_from_cpu);
  m.impl("dequantize_sum", &dequantize_sum_cpu);
}

}  // namespace fsdp_ext
