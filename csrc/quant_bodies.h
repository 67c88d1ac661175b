// Block-quantized collectives (CommPolicy): the per-block bodies, written once for the host and
// the device. csrc/cpu/quantize.cpp runs them over blocks with at::parallel_for (with AVX2
// versions that must stay bit for bit these); csrc/cuda/quantize.cu gives each quantization
// block one warp (quant_warp_bodies.h), which splits it with the same per-element functions
// (amax_add, quantize_code, dequantized_code). The slot layout and the arithmetic are
// fsdp_ext/ops/reference.py's:
//   slot bytes [0, n): codes (int8, or float8_e4m3fn); [align16(n), + 4 * nblocks): fp32 scales.
#pragma once

#include "kernel_bodies.h"

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

FSDP_EXT_HOST_DEVICE float load_scale(const uint8_t* slot, int64_t n, int64_t b) {
  float scale;
  memcpy(&scale, slot + align16(n) + 4 * b, sizeof(scale));
  return scale;
}

// fp32 -> float8_e4m3fn bits, round to nearest even, on integers (branch-free: the host loops
// vectorize), as torch's cast gives them for every float: |x| >= 448 (infinities too) saturates
// to +-448 (0x7E), NaN -> 0x7F. The quantizer meets |x| > 448 when a block's scale is subnormal:
// amax / 448 then keeps few significant bits, and amax / scale reaches 672 (amax = 671 * 2^-149,
// scale 2^-149).
FSDP_EXT_HOST_DEVICE uint32_t e4m3_bits_from_float(float x) {
  const uint32_t bits = float_to_bits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = bits & 0x7fffffffu;
  // |x| >= 2^-6: drop 20 mantissa bits (nearest even), rebias the exponent 127 -> 7.
  const uint32_t normal = ((mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20) - (120u << 3);
  // Below: the value in units of 2^-9 is the 24-bit significand >> (141 - exponent), rounded.
  const uint32_t significand = (mag & 0x7fffffu) | 0x800000u;
  const int32_t wanted = 141 - static_cast<int32_t>(mag >> 23);
  const uint32_t shift = static_cast<uint32_t>(wanted < 21 ? 21 : (wanted > 31 ? 31 : wanted));
  const uint32_t quotient = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t up = (remainder > half) | ((remainder == half) & (quotient & 1u));
  uint32_t result = mag >= 0x3c800000u ? normal : quotient + up;
  result = mag >= 0x43e00000u ? 0x7eu : result;  // 448 and beyond (`normal` would overflow)
  result = mag > 0x7f800000u ? 0x7fu : result;
  return result | sign;
}

FSDP_EXT_HOST_DEVICE float float_from_e4m3_bits(uint32_t code) {
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 7u;
  const float normal = bits_to_float(((exponent + 120u) << 23) | (mantissa << 20));
  const float subnormal = static_cast<float>(mantissa) * 0.001953125f;  // 2^-9, exact
  const uint32_t magnitude = float_to_bits(exponent == 0 ? subnormal : normal);
  const uint32_t value = (exponent == 15u && mantissa == 7u) ? 0x7fc00000u : magnitude;
  return bits_to_float(value | ((code & 0x80u) << 24));
}

// int8's code of q (|q| <= 127.5): rint (round half to even) by the 1.5 * 2^23 trick, exact for
// |q| < 2^22 in the default rounding mode and vectorizable (unlike rintf), then clamped.
FSDP_EXT_HOST_DEVICE uint32_t int8_bits_from_float(float q) {
  const float r = add_rn(add_rn(q, 12582912.0f), -12582912.0f);
  const float clamped = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
  return static_cast<uint32_t>(static_cast<int32_t>(clamped)) & 0xffu;
}

template <bool kFp8>
FSDP_EXT_HOST_DEVICE float code_to_float(uint8_t code) {
  if constexpr (kFp8) {
    return float_from_e4m3_bits(code);
  } else {
    return static_cast<float>(static_cast<int8_t>(code));
  }
}

// The running amax of a block and whether every value so far is finite. Partial results of any
// part of a block merge into the same result in any order (the max of non-NaN floats is exact;
// NaN never wins a compare, and clears `finite` instead), which is what lets the warp kernel
// (quant_warp_bodies.h) and the AVX2 one split a block.
struct BlockAmax {
  float amax;
  uint32_t finite;
};

FSDP_EXT_HOST_DEVICE BlockAmax amax_start() { return BlockAmax{0.0f, 1u}; }

// `value` (as fp32) added to the running amax.
FSDP_EXT_HOST_DEVICE BlockAmax amax_add(BlockAmax part, float value) {
  const float a = fabsf(value);
  part.finite &= static_cast<uint32_t>(a <= 3.40282347e38f);  // 0 for NaN and for infinities
  part.amax = a > part.amax ? a : part.amax;
  return part;
}

FSDP_EXT_HOST_DEVICE BlockAmax amax_merge(BlockAmax a, BlockAmax b) {
  return BlockAmax{b.amax > a.amax ? b.amax : a.amax, a.finite & b.finite};
}

// The block's fp32 scale: amax / 127 (int8) or / 448 (fp8), one IEEE division; NaN when a value
// is not finite.
template <bool kFp8>
FSDP_EXT_HOST_DEVICE float block_scale(BlockAmax block) {
  return block.finite ? div_rn(block.amax, kFp8 ? 448.0f : 127.0f) : NAN;
}

// Whether a block of this scale stores codes; otherwise (scale 0 or NaN) every code is 0.
FSDP_EXT_HOST_DEVICE bool block_is_coded(float scale) { return scale > 0.0f; }

// The code of x in a block of scale `scale` (block_is_coded): x / scale, one IEEE division, then
// int8's rint and clamp or fp8's conversion.
template <bool kFp8>
FSDP_EXT_HOST_DEVICE uint8_t quantize_code(float x, float scale) {
  const float q = div_rn(x, scale);
  return static_cast<uint8_t>(kFp8 ? e4m3_bits_from_float(q) : int8_bits_from_float(q));
}

// Quantize block b (values [starts[b], next start or n)) of src into `slot`: the reference body.
template <class Src, bool kFp8>
FSDP_EXT_HOST_DEVICE void quantize_block(const typename Src::storage* src, int64_t n,
                                         const int64_t* starts, int64_t nblocks, int64_t b,
                                         uint8_t* slot) {
  const int64_t first = starts[b];
  const int64_t count = block_end(starts, nblocks, n, b) - first;
  BlockAmax block = amax_start();
  for (int64_t i = 0; i < count; ++i) block = amax_add(block, Src::to_float(src[first + i]));
  const float scale = block_scale<kFp8>(block);
  memcpy(slot + align16(n) + 4 * b, &scale, sizeof(scale));
  uint8_t* codes = slot + first;
  if (!block_is_coded(scale)) {
    for (int64_t i = 0; i < count; ++i) codes[i] = 0;
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    codes[i] = quantize_code<kFp8>(Src::to_float(src[first + i]), scale);
  }
}

// A code of a block of scale `scale`, dequantized to fp32: one conversion, one multiply.
template <bool kFp8>
FSDP_EXT_HOST_DEVICE float dequantized_code(uint8_t code, float scale) {
  return mul_rn(code_to_float<kFp8>(code), scale);
}

// Value i (of block b) of a slot of n values, dequantized to fp32.
template <bool kFp8>
FSDP_EXT_HOST_DEVICE float dequantized_value(const uint8_t* slot, int64_t n, int64_t b,
                                             int64_t i) {
  return dequantized_code<kFp8>(slot[i], load_scale(slot, n, b));
}

}  // namespace fsdp_ext
