// CPU kernels of the block-quantized collectives (schemas in csrc/ops.cpp, bodies in
// csrc/quant_bodies.h, shared with the CUDA kernels; semantics in fsdp_ext/ops/reference.py).
// Work is split by blocks: a task quantizes, or dequantizes, whole blocks, with the eight-lane
// AVX2 versions of the bodies below where the CPU has AVX2 and F16C (bit for bit the same).
#include "../flat_plan.h"
#include "../quant_avx2.h"  // the eight-lane bodies where the CPU has AVX2 (x86-64 only)
#include "../quant_checks.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace fsdp_ext {
namespace {

// Blocks per task: about 64K values, worth waking a thread for.
int64_t block_grain(int64_t n, int64_t nblocks) {
  const int64_t per_block = std::max<int64_t>(1, n / std::max<int64_t>(1, nblocks));
  return std::max<int64_t>(1, (int64_t{1} << 16) / per_block);
}

#if defined(FSDP_EXT_QUANTIZE_AVX2)
// quantize_block<Src, kFp8> (quant_bodies.h) with eight lanes at a time, bit for bit: the amax
// and the finiteness test are exact whatever the order, each code depends on its value and the
// scale alone, and the remainder of a block runs the reference's own element code. The reference
// body leaves the divisions and the rounding unvectorized (fp32: 1 GB/s in, one thread).
template <class Src, bool kFp8>
FSDP_EXT_AVX2 void quantize_block_avx2(const typename Src::storage* src, int64_t n,
                                       const int64_t* starts, int64_t nblocks, int64_t b,
                                       uint8_t* slot) {
  const int64_t first = starts[b];
  const int64_t count = block_end(starts, nblocks, n, b) - first;
  const typename Src::storage* x = src + first;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 largest = _mm256_set1_ps(3.40282347e38f);
  __m256 vmax = _mm256_setzero_ps();
  __m256 vfinite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 a = _mm256_and_ps(load8_avx2<Src>(x + i), abs_mask);
    vfinite = _mm256_and_ps(vfinite, _mm256_cmp_ps(a, largest, _CMP_LE_OQ));  // false for NaN
    vmax = _mm256_max_ps(vmax, a);  // NaN lanes make it meaningless, but then finite is 0
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  BlockAmax block{0.0f, static_cast<uint32_t>(_mm256_movemask_ps(vfinite) == 0xff)};
  for (float lane : lanes) block = amax_merge(block, BlockAmax{lane, 1u});
  for (; i < count; ++i) block = amax_add(block, Src::to_float(x[i]));
  const float scale = block_scale<kFp8>(block);
  memcpy(slot + align16(n) + 4 * b, &scale, sizeof(scale));
  uint8_t* codes = slot + first;
  if (!block_is_coded(scale)) {
    memset(codes, 0, static_cast<size_t>(count));
    return;
  }
  const __m256 vscale = _mm256_set1_ps(scale);
  // Four vectors to 32 bytes: the packs saturate, which changes nothing (codes are in
  // [-127, 127], or [0, 255] for fp8), and interleave 128-bit halves, which the permute undoes.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (i = 0; i + 32 <= count; i += 32) {
    const __m256i c0 = codes_avx2<kFp8>(load8_avx2<Src>(x + i), vscale);
    const __m256i c1 = codes_avx2<kFp8>(load8_avx2<Src>(x + i + 8), vscale);
    const __m256i c2 = codes_avx2<kFp8>(load8_avx2<Src>(x + i + 16), vscale);
    const __m256i c3 = codes_avx2<kFp8>(load8_avx2<Src>(x + i + 24), vscale);
    __m256i packed;
    if constexpr (kFp8) {
      packed = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    } else {
      packed = _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i),
                        _mm256_permutevar8x32_epi32(packed, order));
  }
  for (; i < count; ++i) codes[i] = quantize_code<kFp8>(Src::to_float(x[i]), scale);
}

// dequantize_blocks<kFp8, kSum, Dst> (below) with eight lanes at a time, bit for bit: per value
// one conversion and one multiply per slot, summed from 0.0f in slot order (kSum), rounded once
// to Dst; each block's remainder through the reference's element code. `scales` holds `world`
// floats of scratch.
template <class Dst, bool kFp8, bool kSum>
FSDP_EXT_AVX2 void dequantize_blocks_avx2(const uint8_t* wire, typename Dst::storage* out,
                                          int64_t n, const int64_t* starts, int64_t nblocks,
                                          int64_t world, int64_t stride, int64_t lo, int64_t hi,
                                          float* scales) {
  const int64_t slots = kSum ? world : 1;
  for (int64_t b = lo; b < hi; ++b) {
    const int64_t end = block_end(starts, nblocks, n, b);
    for (int64_t r = 0; r < slots; ++r) scales[r] = load_scale(wire + r * stride, n, b);
    int64_t i = starts[b];
    for (; i + 8 <= end; i += 8) {
      __m256 total = dequantized_codes_avx2<kFp8>(wire + i, _mm256_set1_ps(scales[0]));
      if constexpr (kSum) {
        total = _mm256_add_ps(_mm256_setzero_ps(), total);
        for (int64_t r = 1; r < slots; ++r) {
          total = _mm256_add_ps(total, dequantized_codes_avx2<kFp8>(wire + r * stride + i,
                                                                    _mm256_set1_ps(scales[r])));
        }
      }
      store8_avx2<Dst>(out + i, total);
    }
    for (; i < end; ++i) {
      float total = dequantized_code<kFp8>(wire[i], scales[0]);
      if constexpr (kSum) {
        total = add_rn(0.0f, total);
        for (int64_t r = 1; r < slots; ++r) {
          total = add_rn(total, dequantized_code<kFp8>(wire[r * stride + i], scales[r]));
        }
      }
      out[i] = Dst::from_float(total);
    }
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
      if (have_avx2_f16c()) {
        for (int64_t b = lo; b < hi; ++b) {
          if (fp8) {
            quantize_block_avx2<S, true>(values, n, first, nblocks, b, out);
          } else {
            quantize_block_avx2<S, false>(values, n, first, nblocks, b, out);
          }
        }
        return;
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
      // int8 codes into fp32 values, one slot: the scalar body below, which the compiler
      // vectorizes itself, is faster than the eight-lane one (20.4 vs 15.9 ms for 64M values on
      // one thread: benchmarks.kernels, dequantize_from int8->fp32).
      constexpr bool kCompilerVectorizes =
          !kSum && std::is_same_v<typename D::storage, float>;
      if (have_avx2_f16c() && (fp8 || !kCompilerVectorizes)) {
        std::vector<float> scales(static_cast<size_t>(kSum ? world : 1));
        if (fp8) {
          dequantize_blocks_avx2<D, true, kSum>(in, values, n, first, nblocks, world, stride, lo,
                                                hi, scales.data());
        } else {
          dequantize_blocks_avx2<D, false, kSum>(in, values, n, first, nblocks, world, stride, lo,
                                                 hi, scales.data());
        }
        return;
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
