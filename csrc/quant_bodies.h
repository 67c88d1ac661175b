// Block-quantized collectives (CommPolicy): the per-block bodies, written once for the host and
// the device. csrc/cpu/quantize.cpp runs them over blocks with at::parallel_for; csrc/cuda/
// quantize.cu gives each quantization block one thread (quantize) or each value one thread
// (dequantize). The slot layout and the arithmetic are fsdp_ext/ops/reference.py's:
//   slot bytes [0, n): codes (int8, or float8_e4m3fn); [align16(n), + 4 * nblocks): fp32 scales.
#pragma once

#include "kernel_bodies.h"

#include <c10/util/Float8_e4m3fn.h>

#include <math.h>
#include <cstdint>
#include <cstring>

namespace fsdp_ext {

FSDP_EXT_HOST_DEVICE int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }

// Bytes of one slot of n values in nblocks blocks.
FSDP_EXT_HOST_DEVICE int64_t quant_slot_bytes(int64_t n, int64_t nblocks) {
  return align16(align16(n) + 4 * nblocks);
}

// [first, end) of block b of `starts` (nblocks sorted offsets, the first 0) over n values.
FSDP_EXT_HOST_DEVICE int64_t block_end(const int64_t* starts, int64_t nblocks, int64_t n,
                                       int64_t b) {
  return b + 1 < nblocks ? starts[b + 1] : n;
}

FSDP_EXT_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

FSDP_EXT_HOST_DEVICE float load_scale(const uint8_t* slot, int64_t n, int64_t b) {
  float scale;
  memcpy(&scale, slot + align16(n) + 4 * b, sizeof(scale));
  return scale;
}

template <bool kFp8>
FSDP_EXT_HOST_DEVICE float code_to_float(uint8_t code) {
  if constexpr (kFp8) {
    return static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits()));
  } else {
    return static_cast<float>(static_cast<int8_t>(code));
  }
}

// Quantize block b (values [starts[b], next start or n)) of src into `slot`.
template <class Src, bool kFp8>
FSDP_EXT_HOST_DEVICE void quantize_block(const typename Src::storage* src, int64_t n,
                                         const int64_t* starts, int64_t nblocks, int64_t b,
                                         uint8_t* slot) {
  const int64_t first = starts[b];
  const int64_t count = block_end(starts, nblocks, n, b) - first;
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < count; ++i) {
    const float a = fabsf(Src::to_float(src[first + i]));
    finite = finite && a <= 3.40282347e38f;  // false for NaN and for infinities
    amax = a > amax ? a : amax;
  }
  const float scale = finite ? div_rn(amax, kFp8 ? 448.0f : 127.0f) : NAN;
  memcpy(slot + align16(n) + 4 * b, &scale, sizeof(scale));
  const bool usable = finite && scale > 0.0f;
  for (int64_t i = 0; i < count; ++i) {
    uint8_t code = 0;
    if (usable) {
      const float q = div_rn(Src::to_float(src[first + i]), scale);
      if constexpr (kFp8) {
        code = c10::Float8_e4m3fn(q).x;
      } else {
        const float r = rintf(q);
        code = static_cast<uint8_t>(static_cast<int8_t>(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r)));
      }
    }
    slot[first + i] = code;
  }
}

// Value i (of block b) of a slot of n values, dequantized to fp32.
template <bool kFp8>
FSDP_EXT_HOST_DEVICE float dequantized_value(const uint8_t* slot, int64_t n, int64_t b,
                                             int64_t i) {
  return mul_rn(code_to_float<kFp8>(slot[i]), load_scale(slot, n, b));
}

}  // namespace fsdp_ext
