// Index math and dtype conversions shared by the CPU and CUDA kernels.
//
// Everything here is plain integer/float code that compiles both with g++ (no CUDA headers) and
// with nvcc for the device, so the CPU tests exercise the exact arithmetic the GPU runs.
//
// [Note: bit-exact casts]
// fp32 -> bf16/fp16 is done with integer bit operations, round-to-nearest-even, identical to
// torch's casts for every non-NaN value (including subnormals, overflow to inf, and ties). NaN stays
// NaN: the sign and the top payload bits are kept and the quiet bit is set (the payload of a NaN is
// not specified by the reference, so the tests compare NaN positions, not NaN bits). Each multiply
// and add is rounded on its own: the CPU build uses -ffp-contract=off and the device uses
// __fmul_rn/__fadd_rn, so no fused multiply-add ever changes a result.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define FSDP_EXT_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// Forced, so the per-element conversions inline into every (vectorized) loop that uses them.
#define FSDP_EXT_HOST_DEVICE inline __attribute__((always_inline))
#else
#define FSDP_EXT_HOST_DEVICE inline
#endif

namespace fsdp_ext {

// Dtype codes used in run tables (host vectors and the int64 tensor sent to the GPU).
enum DtypeCode : int64_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kZeroFill = 3 };

FSDP_EXT_HOST_DEVICE int64_t element_size(int64_t code) { return code == kFloat32 ? 4 : 2; }

// A half-open range [begin, end) of the flat index space.
struct FlatSpan {
  int64_t begin;
  int64_t end;
  FSDP_EXT_HOST_DEVICE bool empty() const { return begin >= end; }
  FSDP_EXT_HOST_DEVICE int64_t size() const { return end - begin; }
};

// The part of the segment [start, start + numel) that lies inside the window [window_begin,
// window_end); empty when they do not meet. Callers have checked that no sum overflows.
FSDP_EXT_HOST_DEVICE FlatSpan clip_to_window(int64_t start, int64_t numel, int64_t window_begin,
                                             int64_t window_end) {
  const int64_t end = start + numel;
  FlatSpan span;
  span.begin = start > window_begin ? start : window_begin;
  span.end = end < window_end ? end : window_end;
  return span;
}

// Index of the last entry of `starts` (sorted ascending, `count` > 0, starts[0] <= position) that is
// <= position: the segment (run, or block range) that `position` falls in. O(log count).
FSDP_EXT_HOST_DEVICE int64_t find_segment(const int64_t* starts, int64_t count, int64_t position) {
  int64_t low = 0, high = count;  // the answer is in [low, high)
  while (high - low > 1) {
    const int64_t mid = low + (high - low) / 2;
    if (starts[mid] <= position) {
      low = mid;
    } else {
      high = mid;
    }
  }
  return low;
}

FSDP_EXT_HOST_DEVICE uint32_t float_to_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

FSDP_EXT_HOST_DEVICE float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// Written with selects instead of early returns so the CPU loops vectorize.
FSDP_EXT_HOST_DEVICE uint16_t float_to_bf16_bits(float value) {
  const uint32_t bits = float_to_bits(value);
  // Adding 0x7fff plus the lowest kept bit rounds the dropped half to nearest even; a carry into
  // the exponent is the correct result (up to and including overflow to inf).
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(is_nan ? quiet_nan : rounded);
}

FSDP_EXT_HOST_DEVICE float bf16_bits_to_float(uint16_t bits) {
  return bits_to_float(static_cast<uint32_t>(bits) << 16);
}

FSDP_EXT_HOST_DEVICE uint16_t float_to_fp16_bits(float value) {
  const uint32_t bits = float_to_bits(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  // Normal halves (|x| >= 2^-14): rebias the exponent from 127 to 15 (subtract 112 << 23) and round
  // the 13 dropped mantissa bits to nearest even; a mantissa carry bumps the exponent, as it must.
  const uint32_t normal = (magnitude - 0x38000000u + 0x0fffu + ((magnitude >> 13) & 1u)) >> 13;
  // Subnormal halves: the 24-bit significand in units of 2^-24 is significand >> (126 - exponent).
  // The shift is clamped to [14, 31] so lanes that take another branch stay well defined; any shift
  // >= 25 correctly rounds to zero (2^-25 itself is a tie and goes to the even value, zero).
  const uint32_t exponent = magnitude >> 23;
  const uint32_t significand = (magnitude & 0x7fffffu) | (exponent != 0 ? 0x800000u : 0u);
  const uint32_t shift = exponent >= 112u ? 14u : (126u - exponent > 31u ? 31u : 126u - exponent);
  const uint32_t truncated = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t subnormal =
      truncated + ((remainder > half || (remainder == half && (truncated & 1u))) ? 1u : 0u);
  const uint32_t quiet_nan = 0x7e00u | ((magnitude >> 13) & 0x3ffu);
  const uint32_t result = magnitude > 0x7f800000u   ? quiet_nan
                          : magnitude >= 0x477ff000u ? 0x7c00u  // >= 65520 rounds to inf
                          : magnitude >= 0x38800000u ? normal
                                                     : subnormal;
  return static_cast<uint16_t>(sign | result);
}

FSDP_EXT_HOST_DEVICE float fp16_bits_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  const uint32_t normal = exponent == 0x1fu ? (0x7f800000u | (mantissa << 13))  // inf / nan
                                            : (((exponent + 112u) << 23) | (mantissa << 13));
  // mantissa * 2^-24 is exact in fp32 and never subnormal there, so flush-to-zero modes cannot
  // change it (and mantissa == 0 gives +0, the sign is or-ed in below).
  const float subnormal = static_cast<float>(static_cast<int32_t>(mantissa)) * 0x1p-24f;
  return bits_to_float(sign | (exponent == 0 ? float_to_bits(subnormal) : normal));
}

// One rounding per operation, never contracted into an fma (see the note at the top).
FSDP_EXT_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FSDP_EXT_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// IEEE division, correctly rounded (nvcc's default `/` is too, unless -prec-div=false; the
// intrinsic says so whatever the flags).
FSDP_EXT_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Element types: `storage` is what memory holds; the kernels never use c10::Half arithmetic.
struct Float32 {
  using storage = float;
  static constexpr int64_t code = kFloat32;
  static FSDP_EXT_HOST_DEVICE float to_float(storage v) { return v; }
  static FSDP_EXT_HOST_DEVICE storage from_float(float v) { return v; }
};
struct BFloat16 {
  using storage = uint16_t;
  static constexpr int64_t code = kBFloat16;
  static FSDP_EXT_HOST_DEVICE float to_float(storage v) { return bf16_bits_to_float(v); }
  static FSDP_EXT_HOST_DEVICE storage from_float(float v) { return float_to_bf16_bits(v); }
};
struct Float16 {
  using storage = uint16_t;
  static constexpr int64_t code = kFloat16;
  static FSDP_EXT_HOST_DEVICE float to_float(storage v) { return fp16_bits_to_float(v); }
  static FSDP_EXT_HOST_DEVICE storage from_float(float v) { return float_to_fp16_bits(v); }
};

// cast(src * scale): through fp32, scaled only when `scaled` (scale != 1), rounded once to Dst.
// An unscaled same-dtype element is copied as is (what the CPU's memcpy path does), so even a
// signalling NaN keeps its bits on every backend.
template <class Src, class Dst>
FSDP_EXT_HOST_DEVICE typename Dst::storage convert_element(typename Src::storage value, float scale,
                                                           bool scaled) {
  if constexpr (std::is_same_v<Src, Dst>) {
    if (!scaled) return value;
  }
  const float x = Src::to_float(value);
  return Dst::from_float(scaled ? mul_rn(x, scale) : x);
}

// How the gradient epilogue applies its divisor, chosen once per call on the host
// (epilogue_divide): not at all for 1; as a multiply by the reciprocal for a power of two, whose
// reciprocal is exact, so the product has the quotient's bits at a multiply's cost; else as a
// division (a multiply by a rounded 1 / divisor would round differently).
enum EpilogueMode : int { kNoDivide = 0, kMultiplyByReciprocal = 1, kDivide = 2 };

struct EpilogueDivide {
  float factor;  // the reciprocal (kMultiplyByReciprocal) or the divisor (kDivide)
  int mode;      // an EpilogueMode
};

inline EpilogueDivide epilogue_divide(double divisor) {
  const float d = static_cast<float>(divisor);
  if (divisor == 1.0) return {1.0f, kNoDivide};
  int exponent = 0;
  const float mantissa = std::frexp(d, &exponent);  // +-0.5 exactly for a power of two
  const float reciprocal = 1.0f / d;
  const bool exact = (mantissa == 0.5f || mantissa == -0.5f) && std::isfinite(reciprocal) &&
                     reciprocal != 0.0f && reciprocal * d == 1.0f;
  return exact ? EpilogueDivide{reciprocal, kMultiplyByReciprocal} : EpilogueDivide{d, kDivide};
}

// The gradient epilogue: cast((out if accumulate else 0) + q), computed in fp32, where q is
// reduced / divisor rounded to reduced's own dtype: torch's FSDP2 divides the reduced gradient in
// the reduce dtype (gloo's AVG, or its post-divide), then casts it to the gradient's dtype and
// accumulates. `factor` and `mode` are epilogue_divide(divisor)'s.
template <class Src, class Dst>
FSDP_EXT_HOST_DEVICE typename Dst::storage epilogue_element(typename Src::storage reduced,
                                                            typename Dst::storage out,
                                                            float factor, int mode,
                                                            bool accumulate) {
  float x = Src::to_float(reduced);
  const float q = mode == kMultiplyByReciprocal ? mul_rn(x, factor) : div_rn(x, factor);
  x = mode != kNoDivide ? Src::to_float(Src::from_float(q)) : x;
  x = accumulate ? add_rn(Dst::to_float(out), x) : x;
  return Dst::from_float(x);
}

// Calls fn(ElementType{}) for a dtype code (kFloat32, kBFloat16 or kFloat16). Host code in a .cu
// passes host lambdas through this __host__ __device__ template, hence the exec-check pragma.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Fn>
FSDP_EXT_HOST_DEVICE void with_element_type(int64_t code, Fn&& fn) {
  if (code == kFloat32) {
    fn(Float32{});
  } else if (code == kBFloat16) {
    fn(BFloat16{});
  } else {
    fn(Float16{});
  }
}

}  // namespace fsdp_ext
