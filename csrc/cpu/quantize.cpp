// CPU kernels of the block-quantized collectives (schemas in csrc/ops.cpp, bodies in
// csrc/quant_bodies.h, shared with the CUDA kernels; semantics in fsdp_ext/ops/reference.py).
// Work is split by blocks: a task quantizes, or dequantizes, whole blocks.
#include "../flat_plan.h"
#include "../quant_checks.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FSDP_EXT_QUANTIZE_AVX2 1
#endif

namespace fsdp_ext {
namespace {

// Blocks per task: about 64K values, worth waking a thread for.
int64_t block_grain(int64_t n, int64_t nblocks) {
  const int64_t per_block = std::max<int64_t>(1, n / std::max<int64_t>(1, nblocks));
  return std::max<int64_t>(1, (int64_t{1} << 16) / per_block);
}

#if defined(FSDP_EXT_QUANTIZE_AVX2)
bool have_avx2() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}

// e4m3_bits_from_float (quant_bodies.h) on eight lanes: the same integer operations, so the same
// bits. Every lane value below stays under 2^31, so the signed compares act as unsigned ones.
__attribute__((target("avx2"))) inline __m256i e4m3_bits_avx2(__m256 x) {
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

// One 8-lane vector of codes (as int32 lanes) of x / scale: the reference's arithmetic, one IEEE
// division and then int8's rint by the 1.5 * 2^23 trick and clamp, or the fp8 bit conversion.
template <bool kFp8>
__attribute__((target("avx2"))) inline __m256i codes_avx2(__m256 x, __m256 scale) {
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

// quantize_block<F32, kFp8> (quant_bodies.h) with eight lanes at a time, bit for bit: the amax
// and the finiteness test are exact whatever the order, each code depends on its value and the
// scale alone, and the remainder of a block runs the reference's own element code. The reference
// body leaves the divisions and the rounding unvectorized (1 GB/s of fp32 in, one thread).
template <bool kFp8>
__attribute__((target("avx2"))) void quantize_block_f32_avx2(const float* src, int64_t n,
                                                             const int64_t* starts,
                                                             int64_t nblocks, int64_t b,
                                                             uint8_t* slot) {
  const int64_t first = starts[b];
  const int64_t count = block_end(starts, nblocks, n, b) - first;
  const float* x = src + first;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 largest = _mm256_set1_ps(3.40282347e38f);
  __m256 vmax = _mm256_setzero_ps();
  __m256 vfinite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
    vfinite = _mm256_and_ps(vfinite, _mm256_cmp_ps(a, largest, _CMP_LE_OQ));  // false for NaN
    vmax = _mm256_max_ps(vmax, a);  // NaN lanes make it meaningless, but then finite is 0
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.0f;
  for (float lane : lanes) amax = lane > amax ? lane : amax;
  uint32_t finite = _mm256_movemask_ps(vfinite) == 0xff;
  for (; i < count; ++i) {
    const float a = fabsf(x[i]);
    finite &= static_cast<uint32_t>(a <= 3.40282347e38f);
    amax = a > amax ? a : amax;
  }
  const float scale = finite ? div_rn(amax, kFp8 ? 448.0f : 127.0f) : NAN;
  memcpy(slot + align16(n) + 4 * b, &scale, sizeof(scale));
  uint8_t* codes = slot + first;
  if (!(finite && scale > 0.0f)) {
    memset(codes, 0, static_cast<size_t>(count));
    return;
  }
  const __m256 vscale = _mm256_set1_ps(scale);
  // Four vectors to 32 bytes: the packs saturate, which changes nothing (codes are in
  // [-127, 127], or [0, 255] for fp8), and interleave 128-bit halves, which the permute undoes.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (i = 0; i + 32 <= count; i += 32) {
    const __m256i c0 = codes_avx2<kFp8>(_mm256_loadu_ps(x + i), vscale);
    const __m256i c1 = codes_avx2<kFp8>(_mm256_loadu_ps(x + i + 8), vscale);
    const __m256i c2 = codes_avx2<kFp8>(_mm256_loadu_ps(x + i + 16), vscale);
    const __m256i c3 = codes_avx2<kFp8>(_mm256_loadu_ps(x + i + 24), vscale);
    __m256i packed;
    if constexpr (kFp8) {
      packed = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    } else {
      packed = _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i),
                        _mm256_permutevar8x32_epi32(packed, order));
  }
  for (; i < count; ++i) {
    const float q = div_rn(x[i], scale);
    codes[i] = static_cast<uint8_t>(kFp8 ? e4m3_bits_from_float(q) : int8_bits_from_float(q));
  }
}

// float_from_e4m3_bits (quant_bodies.h) on eight lanes of codes (int32 lanes, 0-255): the same
// bit assembly, and the subnormal's mantissa * 2^-9, exact, as the same multiply.
__attribute__((target("avx2"))) inline __m256 e4m3_values_avx2(__m256i code) {
  const __m256i exponent = _mm256_and_si256(_mm256_srli_epi32(code, 3), _mm256_set1_epi32(0xf));
  const __m256i mantissa = _mm256_and_si256(code, _mm256_set1_epi32(7));
  const __m256i normal =
      _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(exponent, _mm256_set1_epi32(120)), 23),
                      _mm256_slli_epi32(mantissa, 20));
  const __m256i subnormal = _mm256_castps_si256(
      _mm256_mul_ps(_mm256_cvtepi32_ps(mantissa), _mm256_set1_ps(0.001953125f)));
  __m256i magnitude = _mm256_blendv_epi8(
      normal, subnormal, _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256()));
  magnitude = _mm256_blendv_epi8(
      magnitude, _mm256_set1_epi32(0x7fc00000),
      _mm256_and_si256(_mm256_cmpeq_epi32(exponent, _mm256_set1_epi32(15)),
                       _mm256_cmpeq_epi32(mantissa, _mm256_set1_epi32(7))));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(magnitude, sign));
}

// dequantize_blocks<true, false, F32> with eight lanes at a time, bit for bit (one conversion and
// one multiply per value, as the reference; its body does each block's remainder). The reference
// body leaves the fp8 decode unvectorized.
__attribute__((target("avx2"))) void dequantize_fp8_blocks_f32_avx2(const uint8_t* slot,
                                                                    float* out, int64_t n,
                                                                    const int64_t* starts,
                                                                    int64_t nblocks, int64_t lo,
                                                                    int64_t hi) {
  for (int64_t b = lo; b < hi; ++b) {
    const int64_t end = block_end(starts, nblocks, n, b);
    const float scale = load_scale(slot, n, b);
    const __m256 vscale = _mm256_set1_ps(scale);
    int64_t i = starts[b];
    for (; i + 8 <= end; i += 8) {
      const __m256i code =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(slot + i)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(e4m3_values_avx2(code), vscale));
    }
    for (; i < end; ++i) out[i] = mul_rn(float_from_e4m3_bits(slot[i]), scale);
  }
}
#endif

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
#if defined(FSDP_EXT_QUANTIZE_AVX2)
      if constexpr (std::is_same_v<typename S::storage, float>) {
        if (have_avx2()) {
          for (int64_t b = lo; b < hi; ++b) {
            if (fp8) {
              quantize_block_f32_avx2<true>(values, n, first, nblocks, b, out);
            } else {
              quantize_block_f32_avx2<false>(values, n, first, nblocks, b, out);
            }
          }
          return;
        }
      }
#endif
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
#if defined(FSDP_EXT_QUANTIZE_AVX2)
      if constexpr (!kSum && std::is_same_v<typename D::storage, float>) {
        if (fp8 && have_avx2()) {
          dequantize_fp8_blocks_f32_avx2(in, values, n, first, nblocks, lo, hi);
          return;
        }
      }
#endif
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
