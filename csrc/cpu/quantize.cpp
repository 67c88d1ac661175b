// CPU kernels of the block-quantized collectives (schemas in csrc/ops.cpp, bodies in
// csrc/quant_bodies.h, shared with the CUDA kernels; semantics in fsdp_ext/ops/reference.py).
#include "../checks.h"
#include "../flat_plan.h"
#include "../quant_bodies.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

namespace fsdp_ext {
namespace {

// Quantization blocks per task: a few hundred KB of values, worth a thread.
int64_t block_grain(int64_t block) { return std::max<int64_t>(1, (1 << 16) / block); }

void check_wire(const at::Tensor& wire, int64_t n, int64_t slots, int64_t block) {
  FSDP_EXT_CHECK(wire.device().is_cpu() && wire.scalar_type() == at::kByte && wire.dim() == 1 &&
                     wire.is_contiguous(),
                 "wire must be a contiguous 1-D uint8 CPU tensor");
  FSDP_EXT_CHECK(block > 0 && block % 8 == 0, "block ", block, " is not a positive multiple of 8");
  FSDP_EXT_CHECK(wire.numel() >= slots * quant_slot_bytes(n, block), "wire has ", wire.numel(),
                 " bytes; ", slots, " slot(s) of ", n, " values need ",
                 slots * quant_slot_bytes(n, block));
}

// src: n values (fp32/bf16/fp16); wire: at least (slot + 1) slots of n values.
void quantize_into_slot_cpu(const at::Tensor& src, const at::Tensor& wire, int64_t slot,
                            int64_t block, bool fp8) {
  CHECK_TENSOR(src, "src", wire.device());
  const int64_t n = src.numel();
  CHECK_NON_NEGATIVE(slot, "slot");
  check_wire(wire, n, slot + 1, block);
  uint8_t* out = wire.mutable_data_ptr<uint8_t>() + slot * quant_slot_bytes(n, block);
  const char* in = static_cast<const char*>(src.const_data_ptr());
  with_element_type(dtype_code(src.scalar_type()), [&](auto src_type) {
    using S = decltype(src_type);
    const auto* values = reinterpret_cast<const typename S::storage*>(in);
    at::parallel_for(0, quant_blocks(n, block), block_grain(block), [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        if (fp8) {
          quantize_block<S, true>(values, n, block, b, out);
        } else {
          quantize_block<S, false>(values, n, block, b, out);
        }
      }
    });
  });
}

template <bool kFp8, class D>
void dequantize_slots_span(const uint8_t* wire, typename D::storage* out, int64_t n,
                           int64_t block, int64_t begin, int64_t end) {
  const int64_t stride = quant_slot_bytes(n, block);
  for (int64_t j = begin; j < end; ++j) {  // value j of the W * n outputs: slot j / n
    const int64_t r = j / n;
    out[j] = D::from_float(dequantized_value<kFp8>(wire + r * stride, n, block, j - r * n));
  }
}

// wire: world slots of n values; out: world * n values.
void dequantize_slots_cpu(const at::Tensor& wire, const at::Tensor& out, int64_t world,
                          int64_t block, bool fp8) {
  CHECK_TENSOR(out, "out", wire.device());
  FSDP_EXT_CHECK(world > 0 && out.numel() % world == 0, "out has ", out.numel(),
                 " values, not a multiple of world ", world);
  const int64_t n = out.numel() / world;
  check_wire(wire, n, world, block);
  const uint8_t* in = wire.const_data_ptr<uint8_t>();
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  with_element_type(dtype_code(out.scalar_type()), [&](auto dst_type) {
    using D = decltype(dst_type);
    auto* values = reinterpret_cast<typename D::storage*>(dst);
    at::parallel_for(0, out.numel(), 1 << 15, [&](int64_t lo, int64_t hi) {
      if (fp8) {
        dequantize_slots_span<true, D>(in, values, n, block, lo, hi);
      } else {
        dequantize_slots_span<false, D>(in, values, n, block, lo, hi);
      }
    });
  });
}

template <bool kFp8, class D>
void dequantize_sum_span(const uint8_t* wire, typename D::storage* out, int64_t n, int64_t world,
                         int64_t block, int64_t begin, int64_t end) {
  const int64_t stride = quant_slot_bytes(n, block);
  for (int64_t i = begin; i < end; ++i) {
    float total = 0.0f;
    for (int64_t r = 0; r < world; ++r) {
      total = add_rn(total, dequantized_value<kFp8>(wire + r * stride, n, block, i));
    }
    out[i] = D::from_float(total);
  }
}

// wire: world slots of n values; out: n values, their sum over the slots.
void dequantize_sum_cpu(const at::Tensor& wire, const at::Tensor& out, int64_t world,
                        int64_t block, bool fp8) {
  CHECK_TENSOR(out, "out", wire.device());
  const int64_t n = out.numel();
  check_wire(wire, n, world, block);
  const uint8_t* in = wire.const_data_ptr<uint8_t>();
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  with_element_type(dtype_code(out.scalar_type()), [&](auto dst_type) {
    using D = decltype(dst_type);
    auto* values = reinterpret_cast<typename D::storage*>(dst);
    at::parallel_for(0, n, 1 << 14, [&](int64_t lo, int64_t hi) {
      if (fp8) {
        dequantize_sum_span<true, D>(in, values, n, world, block, lo, hi);
      } else {
        dequantize_sum_span<false, D>(in, values, n, world, block, lo, hi);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdp_ext, CPU, m) {
  m.impl("quantize_into_slot", &quantize_into_slot_cpu);
  m.impl("dequantize_slots", &dequantize_slots_cpu);
  m.impl("dequantize_sum", &dequantize_sum_cpu);
}

}  // namespace fsdp_ext
