// Eight-lane AVX2 versions of flat_layout.h's bit-exact casts, shared by the CPU kernels
// (csrc/cpu/flat_param.cpp, csrc/quant_avx2.h). Each is the scalar function's own integer
// operations on eight lanes, so the same bits; callers check the CPU (__builtin_cpu_supports).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cstdint>

namespace fsdp_ext {

// float_to_bf16_bits on eight lanes (results in the low 16 bits of each 32-bit lane).
__attribute__((target("avx2"))) inline __m256i bf16_bits_avx2(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)),
                       _mm256_and_si256(high, _mm256_set1_epi32(1))),
      16);
  const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x0040));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
}

}  // namespace fsdp_ext
#endif
