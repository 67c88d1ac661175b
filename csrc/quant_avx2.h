// Eight-lane AVX2 (and F16C) versions of quant_bodies.h's per-element functions, for the CPU
// quantized kernels (csrc/cpu/quantize.cpp): each does the scalar function's operations on eight
// lanes, one IEEE operation per lane where the scalar does one, so the same bits. Callers check
// the CPU first (have_avx2_f16c).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define FSDP_EXT_QUANTIZE_AVX2 1
#include "avx2_casts.h"
#include "cpu_vector.h"
#include "quant_bodies.h"

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#define FSDP_EXT_AVX2 __attribute__((target("avx2,f16c")))

namespace fsdp_ext {

// The switch of cpu_vector.h: the CPU has AVX2 and F16C and FSDP_EXT_CPU_VECTOR allows them.
inline bool have_avx2_f16c() { return use_avx2(/*needs_f16c=*/true); }

// Eight values of Src at p as fp32: exact for fp32 and bf16 (bits << 16) and fp16 (F16C; it
// quiets a signalling NaN, which only ever makes a block non-finite, as any NaN does).
template <class Src>
FSDP_EXT_AVX2 inline __m256 load8_avx2(const typename Src::storage* p) {
  if constexpr (std::is_same_v<Src, Float32>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<Src, BFloat16>) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// Eight fp32 lanes stored as Dst at p, rounded as Dst::from_float: bf16 by the same bit
// operations, fp16 by F16C's round to nearest even (float_to_fp16_bits' bits, NaNs included).
template <class Dst>
FSDP_EXT_AVX2 inline void store8_avx2(typename Dst::storage* p, __m256 x) {
  if constexpr (std::is_same_v<Dst, Float32>) {
    _mm256_storeu_ps(p, x);
  } else if constexpr (std::is_same_v<Dst, BFloat16>) {
    const __m256i bits = bf16_bits_avx2(x);  // lanes below 2^16: the pack is exact
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                      _mm256_extracti128_si256(bits, 1)));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// e4m3_bits_from_float on eight lanes: the same integer operations. Every lane value below stays
// under 2^31, so the signed compares act as unsigned ones.
FSDP_EXT_AVX2 inline __m256i e4m3_bits_avx2(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i normal = _mm256_sub_epi32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(0x7ffff)),
                                         _mm256_and_si256(_mm256_srli_epi32(mag, 20), one)),
                        20),
      _mm256_set1_epi32(120 << 3));
  const __m256i significand =
      _mm256_or_si256(_mm256_and_si256(mag, _mm256_set1_epi32(0x7fffff)),
                      _mm256_set1_epi32(0x800000));
  const __m256i wanted = _mm256_sub_epi32(_mm256_set1_epi32(141), _mm256_srli_epi32(mag, 23));
  const __m256i shift = _mm256_min_epi32(_mm256_max_epi32(wanted, _mm256_set1_epi32(21)),
                                         _mm256_set1_epi32(31));
  const __m256i quotient = _mm256_srlv_epi32(significand, shift);
  const __m256i remainder =
      _mm256_and_si256(significand, _mm256_sub_epi32(_mm256_sllv_epi32(one, shift), one));
  const __m256i half = _mm256_sllv_epi32(one, _mm256_sub_epi32(shift, one));
  const __m256i up = _mm256_or_si256(  // all ones where the quotient rounds up
      _mm256_cmpgt_epi32(remainder, half),
      _mm256_and_si256(_mm256_cmpeq_epi32(remainder, half),
                       _mm256_cmpeq_epi32(_mm256_and_si256(quotient, one), one)));
  __m256i result = _mm256_blendv_epi8(_mm256_sub_epi32(quotient, up), normal,
                                      _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x3c7fffff)));
  result = _mm256_blendv_epi8(result, _mm256_set1_epi32(0x7e),
                              _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x43dfffff)));
  result = _mm256_blendv_epi8(result, _mm256_set1_epi32(0x7f),
                              _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000)));
  return _mm256_or_si256(result, sign);
}

// quantize_code on eight lanes (codes as int32 lanes): one IEEE division, then int8's rint by the
// same 1.5 * 2^23 trick and clamp, or the fp8 bit conversion.
template <bool kFp8>
FSDP_EXT_AVX2 inline __m256i codes_avx2(__m256 x, __m256 scale) {
  const __m256 q = _mm256_div_ps(x, scale);
  if constexpr (kFp8) {
    return e4m3_bits_avx2(q);
  } else {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 r = _mm256_sub_ps(_mm256_add_ps(q, magic), magic);
    // q is finite here (finite block, scale > 0), so min/max clamp as the reference's selects.
    const __m256 clamped = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)),
                                         _mm256_set1_ps(127.0f));
    return _mm256_cvttps_epi32(clamped);
  }
}

// float_from_e4m3_bits on eight lanes of codes (int32 lanes, 0-255), the same bits with fewer
// operations: a normal code's fp32 bits are its 7 magnitude bits << 20 plus the exponent's
// rebias (120 << 23), as exponent and mantissa assembled apart; the subnormal's mantissa * 2^-9
// is the same exact multiply (never of a subnormal operand, so denormals-are-zero modes cannot
// change it).
FSDP_EXT_AVX2 inline __m256 e4m3_values_avx2(__m256i code) {
  const __m256i magnitude_code = _mm256_and_si256(code, _mm256_set1_epi32(0x7f));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(magnitude_code, 20),
                                          _mm256_set1_epi32(120 << 23));
  const __m256i subnormal = _mm256_castps_si256(
      _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude_code), _mm256_set1_ps(0.001953125f)));
  __m256i magnitude = _mm256_blendv_epi8(
      subnormal, normal, _mm256_cmpgt_epi32(magnitude_code, _mm256_set1_epi32(7)));
  magnitude = _mm256_blendv_epi8(magnitude, _mm256_set1_epi32(0x7fc00000),
                                 _mm256_cmpeq_epi32(magnitude_code, _mm256_set1_epi32(0x7f)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(magnitude, sign));
}

// dequantized_code on the eight codes at p: code_to_float (int8: exact conversion), then one
// multiply by the scale.
template <bool kFp8>
FSDP_EXT_AVX2 inline __m256 dequantized_codes_avx2(const uint8_t* p, __m256 scale) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (kFp8) {
    return _mm256_mul_ps(e4m3_values_avx2(_mm256_cvtepu8_epi32(bytes)), scale);
  } else {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
  }
}

}  // namespace fsdp_ext
#endif
