// Argument checks of the quantized collectives' ops, shared by the CPU and CUDA kernels
// (csrc/cpu/quantize.cpp, csrc/cuda/quantize.cu); the Python backends' twin is
// fsdp_ext/ops/checks.py: check_quantized.
#pragma once

#include "checks.h"
#include "quant_bodies.h"

namespace fsdp_ext {

// values: n elements (fp32/bf16/fp16) on the bytes' device; bytes (named `bytes_name`): 1-D
// uint8 of at least `need` bytes; starts: 1-D int64 block starts beside them.
inline void check_quantized_args(const at::Tensor& values, const char* values_name,
                                 const at::Tensor& bytes, const char* bytes_name,
                                 const at::Tensor& starts, int64_t need) {
  CHECK_TENSOR(values, values_name, bytes.device());
  FSDP_EXT_CHECK(bytes.scalar_type() == at::kByte && bytes.dim() == 1 && bytes.is_contiguous(),
                 bytes_name, " must be a contiguous 1-D uint8 tensor");
  FSDP_EXT_CHECK(starts.scalar_type() == at::kLong && starts.dim() == 1 &&
                     starts.is_contiguous() && starts.device() == bytes.device(),
                 "starts must be a contiguous 1-D int64 tensor on the bytes' device");
  FSDP_EXT_CHECK(values.numel() == 0 || starts.numel() > 0, "starts: n > 0 values need a block");
  FSDP_EXT_CHECK(bytes.numel() >= need, bytes_name, " has ", bytes.numel(), " bytes, needs ",
                 need);
}

// src: n values -> slot: one slot of n values in starts.numel() blocks.
inline void check_quantize_into_args(const at::Tensor& src, const at::Tensor& slot,
                                     const at::Tensor& starts) {
  check_quantized_args(src, "src", slot, "slot", starts,
                       quant_slot_bytes(src.numel(), starts.numel()));
}

// slot -> out: n values.
inline void check_dequantize_from_args(const at::Tensor& slot, const at::Tensor& out,
                                       const at::Tensor& starts) {
  check_quantized_args(out, "out", slot, "slot", starts,
                       quant_slot_bytes(out.numel(), starts.numel()));
}

// wire: `world` slots `stride` bytes apart, each of out.numel() values -> out: their sum.
inline void check_dequantize_sum_args(const at::Tensor& wire, const at::Tensor& out,
                                      const at::Tensor& starts, int64_t world, int64_t stride) {
  const int64_t need = quant_slot_bytes(out.numel(), starts.numel());
  FSDP_EXT_CHECK(world >= 1, "world must be >= 1");
  FSDP_EXT_CHECK(world == 1 || stride >= need, "stride ", stride, " is below a slot's ", need);
  check_quantized_args(out, "out", wire, "wire", starts, (world - 1) * stride + need);
}

}  // namespace fsdp_ext
