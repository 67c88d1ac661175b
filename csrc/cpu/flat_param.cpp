// CPU kernels for the four ops (schemas in csrc/ops.cpp, semantics in fsdp_ext/ops/reference.py).
//
// One call handles any number of tensors: the host plan (flat_plan.h) lists the runs of the window,
// and at::parallel_for splits the runs' total length into equal pieces, so the work is balanced by
// elements moved rather than by tensor count. Same-dtype unscaled runs are copied (vector moves for
// short runs, streaming stores when the call's output is larger than the cache, else memcpy); casts
// go through the shared bit-exact conversions of flat_layout.h in plain loops the compiler
// vectorizes.
//
// The unit of 1000 small tensors is where per-tensor costs show, so pack and unpack are boxed
// kernels that read their list arguments in place (boxed_args.h), check and plan in one pass each
// without allocating (scratch vectors reused per thread), and stay on the calling thread when the
// work is too small to be worth waking other threads.
#include "../boxed_args.h"  // first: includes Python.h
#include "../checks.h"
#include "../flat_layout.h"
#include "../flat_plan.h"
#include "../avx2_casts.h"
#include "../cpu_vector.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace fsdp_ext {
namespace {

// Below this many elements per task, starting a thread costs more than the copy it would take over.
constexpr int64_t kGrainElements = 1 << 15;

// Nor is a task worth a thread below this many bytes moved (read + written): about a millisecond of
// one core's copying. Waking a pool thread costs microseconds on an idle machine, but on a busy one
// the caller can wait a whole scheduler slice (milliseconds) for it, and the copies are bound by
// memory bandwidth that a second core barely adds to.
constexpr int64_t kGrainBytes = int64_t{32} << 20;

// Grain (elements per task) for at::parallel_for over elements that move `bytes_per_element` each.
int64_t grain_for(int64_t bytes_per_element) {
  return std::max(kGrainElements, kGrainBytes / std::max<int64_t>(bytes_per_element, 1));
}

// Same-dtype runs shorter than this are copied with explicit unaligned vector moves rather than
// memcpy: for a destination misaligned against its source (any odd offset in a flat buffer), glibc
// picks `rep movsb` for copies of a few KiB and up, which AMD Zen cores run up to 10x slower than
// vector moves (measured here: 4 KiB to 64 KiB pieces).
constexpr int64_t kVectorCopyMaxBytes = int64_t{1} << 20;

// A call that writes at least this many bytes copies with non-temporal (streaming) stores: its
// output cannot stay in the cache anyway (last-level cache: 32 MiB here), and stores that skip the
// cache do not first read each destination line. Measured here for one copy: 8 MiB ties with
// memcpy (56 vs 56-60 GB/s), 16 MiB and up is 1.4-1.8x faster (33 vs 19-24 GB/s); glibc's memcpy
// does not switch to such stores at these sizes on this CPU.
constexpr int64_t kStreamMinBytes = int64_t{16} << 20;

#if defined(__x86_64__) && defined(__GNUC__)
// Copies the whole 128-byte steps of `bytes`; returns how many bytes that was. kStream: with
// streaming stores, which need `out` 32-byte aligned.
template <bool kStream>
__attribute__((target("avx2"))) int64_t copy_steps_avx2(const char* in, char* out, int64_t bytes) {
  int64_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    __m256i v[4];
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 32 * k));
    }
    for (int k = 0; k < 4; ++k) {
      auto* to = reinterpret_cast<__m256i*>(out + i + 32 * k);
      if constexpr (kStream) {
        _mm256_stream_si256(to, v[k]);
      } else {
        _mm256_storeu_si256(to, v[k]);
      }
    }
  }
  return i;
}

__attribute__((target("avx2"))) void copy_bytes_avx2(const char* in, char* out, int64_t bytes) {
  // bytes >= 32. 128-byte steps, then single 32-byte moves, then the last 32 bytes (which may
  // overlap the previous store: same values, as source and destination do not partially overlap).
  int64_t i = copy_steps_avx2<false>(in, out, bytes);
  for (; i + 32 <= bytes; i += 32) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
  }
  if (i < bytes) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + bytes - 32),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + bytes - 32)));
  }
}

// The same with streaming stores: the unaligned head and the tail go through memcpy. The fence
// orders the streaming stores before whatever this thread does next (at::parallel_for's join,
// the caller's reads).
__attribute__((target("avx2"))) void stream_bytes_avx2(const char* in, char* out, int64_t bytes) {
  const int64_t head =
      std::min<int64_t>(bytes, (32 - static_cast<int64_t>(reinterpret_cast<uintptr_t>(out) & 31)) & 31);
  std::memcpy(out, in, head);
  const int64_t done = head + copy_steps_avx2<true>(in + head, out + head, bytes - head);
  _mm_sfence();
  std::memcpy(out + done, in + done, bytes - done);
}

// fp32 -> bf16 (optionally scaled first), the same bit operations as float_to_bf16_bits on eight
// lanes at a time (avx2_casts.h). The compiler's vectorization of the element loop narrows 32-bit
// lanes to 16 bits one half-register at a time; packing two registers with one pack + one lane
// permute is 1.7x faster on in-cache data here, which is what the small-tensor units move.
__attribute__((target("avx2"))) void float_to_bf16_avx2(const float* in, uint16_t* out, int64_t n,
                                                        float scale, bool scaled) {
  const __m256 factor = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm256_loadu_ps(in + i);
    __m256 b = _mm256_loadu_ps(in + i + 8);
    if (scaled) {
      a = _mm256_mul_ps(a, factor);  // rounded like mul_rn: no fused operation follows
      b = _mm256_mul_ps(b, factor);
    }
    // Lanes hold values below 2^16, so the saturating pack is exact; it interleaves the 128-bit
    // halves of a and b, which the permute puts back in order.
    const __m256i packed = _mm256_packus_epi32(bf16_bits_avx2(a), bf16_bits_avx2(b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_permute4x64_epi64(packed, 0xD8));
  }
  for (; i < n; ++i) out[i] = float_to_bf16_bits(scaled ? mul_rn(in[i], scale) : in[i]);
}

// fp32 -> fp16 (optionally scaled first) with the F16C conversion, rounding to nearest even: the
// same bits as float_to_fp16_bits for every input (subnormal halves, overflow to inf, and NaNs
// quieted with the top mantissa bits kept); about 10x faster than the portable version here on
// the unit of 1000 small tensors (2.9 -> 0.29 ms).
__attribute__((target("avx2,f16c"))) void float_to_fp16_f16c(const float* in, uint16_t* out,
                                                             int64_t n, float scale, bool scaled) {
  const __m256 factor = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(in + i);
    if (scaled) x = _mm256_mul_ps(x, factor);  // rounded like mul_rn: no fused operation follows
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) out[i] = float_to_fp16_bits(scaled ? mul_rn(in[i], scale) : in[i]);
}

#endif

// A same-dtype copy of `bytes` bytes; source and destination are equal or do not overlap.
// `stream`: the whole call writes at least kStreamMinBytes (see there).
void copy_bytes(const void* src, void* dst, int64_t bytes, bool stream) {
  if (src == dst || bytes <= 0) return;
#if defined(__x86_64__) && defined(__GNUC__)
  if (bytes >= 32 && use_avx2()) {
    if (stream) {
      stream_bytes_avx2(static_cast<const char*>(src), static_cast<char*>(dst), bytes);
      return;
    }
    if (bytes < kVectorCopyMaxBytes) {
      copy_bytes_avx2(static_cast<const char*>(src), static_cast<char*>(dst), bytes);
      return;
    }
  }
#endif
  std::memcpy(dst, src, bytes);
}

// The fp32->fp16 rounding shifts each lane by its own amount, which x86 vectorizes only from AVX2
// on: each element loop is built twice, for AVX2 and for the baseline, and the switch of
// cpu_vector.h picks one per call (a target_clones ifunc would pick by the CPU alone, and the
// baseline loops would go untested on an AVX2 machine).
#if defined(__x86_64__) && defined(__linux__)
#define FSDP_EXT_HAS_AVX2_LOOPS 1
#define FSDP_EXT_INLINE_BODY inline __attribute__((always_inline))
#else
#define FSDP_EXT_INLINE_BODY inline
#endif

// The element loops: one instantiation per (dtypes, flags), so each body is branch-free.
template <class Src, class Dst, bool kScaled>
FSDP_EXT_INLINE_BODY void convert_body(const typename Src::storage* in,
                                       typename Dst::storage* out, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = convert_element<Src, Dst>(in[i], scale, kScaled);
}

template <class Src, class Dst, int kMode, bool kAccumulate>
FSDP_EXT_INLINE_BODY void epilogue_body(const typename Src::storage* in,
                                        typename Dst::storage* acc, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) {
    acc[i] = epilogue_element<Src, Dst>(in[i], acc[i], factor, kMode, kAccumulate);
  }
}

#if defined(FSDP_EXT_HAS_AVX2_LOOPS)
template <class Src, class Dst, bool kScaled>
__attribute__((target("avx2"))) void convert_body_avx2(const typename Src::storage* in,
                                                        typename Dst::storage* out, int64_t n,
                                                        float scale) {
  convert_body<Src, Dst, kScaled>(in, out, n, scale);
}

template <class Src, class Dst, int kMode, bool kAccumulate>
__attribute__((target("avx2"))) void epilogue_body_avx2(const typename Src::storage* in,
                                                         typename Dst::storage* acc, int64_t n,
                                                         float factor) {
  epilogue_body<Src, Dst, kMode, kAccumulate>(in, acc, n, factor);
}
#endif

template <class Src, class Dst, bool kScaled>
void convert_loop(const typename Src::storage* in, typename Dst::storage* out, int64_t n,
                  float scale) {
#if defined(FSDP_EXT_HAS_AVX2_LOOPS)
  if (use_avx2()) {
    convert_body_avx2<Src, Dst, kScaled>(in, out, n, scale);
    return;
  }
#endif
  convert_body<Src, Dst, kScaled>(in, out, n, scale);
}

template <class Src, class Dst, int kMode, bool kAccumulate>
void epilogue_loop(const typename Src::storage* in, typename Dst::storage* acc, int64_t n,
                   float factor) {
#if defined(FSDP_EXT_HAS_AVX2_LOOPS)
  if (use_avx2()) {
    epilogue_body_avx2<Src, Dst, kMode, kAccumulate>(in, acc, n, factor);
    return;
  }
#endif
  epilogue_body<Src, Dst, kMode, kAccumulate>(in, acc, n, factor);
}

template <class Src, class Dst>
void convert_span(const void* src, void* dst, int64_t n, float scale, bool scaled, bool stream) {
  const auto* in = static_cast<const typename Src::storage*>(src);
  auto* out = static_cast<typename Dst::storage*>(dst);
  if constexpr (std::is_same_v<Src, Dst>) {
    if (!scaled) {
      copy_bytes(in, out, n * static_cast<int64_t>(sizeof(*out)), stream);
      return;
    }
  }
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<Src, Float32> && std::is_same_v<Dst, BFloat16>) {
    if (use_avx2()) {
      float_to_bf16_avx2(in, out, n, scale, scaled);
      return;
    }
  }
  if constexpr (std::is_same_v<Src, Float32> && std::is_same_v<Dst, Float16>) {
    if (use_avx2(/*needs_f16c=*/true)) {
      float_to_fp16_f16c(in, out, n, scale, scaled);
      return;
    }
  }
#endif
  if (scaled) {
    convert_loop<Src, Dst, true>(in, out, n, scale);
  } else {
    convert_loop<Src, Dst, false>(in, out, n, scale);
  }
}

// n elements from src (dtype code src_code) to dst (dst_code): cast(src * scale). `stream`: see
// copy_bytes.
void convert(int64_t src_code, const void* src, int64_t dst_code, void* dst, int64_t n,
             float scale, bool scaled, bool stream) {
  with_element_type(src_code, [&](auto src_type) {
    with_element_type(dst_code, [&](auto dst_type) {
      convert_span<decltype(src_type), decltype(dst_type)>(src, dst, n, scale, scaled, stream);
    });
  });
}

// Calls piece(run, offset_in_run, count) over all runs, in parallel pieces of equal length (on the
// calling thread alone when the work is small; see kGrainBytes).
template <class Piece>
void for_each_piece(const std::vector<FlatRun>& runs, int64_t bytes_per_element,
                    const Piece& piece) {
  if (runs.empty()) return;
  int64_t total = 0;
  for (const FlatRun& run : runs) total += run.length;
  const int64_t grain = grain_for(bytes_per_element);
  if (total <= grain || at::get_num_threads() == 1 || at::in_parallel_region()) {
    for (const FlatRun& run : runs) piece(run, 0, run.length);
    return;
  }
  const std::vector<int64_t> begins = work_begins(runs);
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    int64_t r = find_segment(begins.data(), static_cast<int64_t>(begins.size()), begin);
    while (begin < end) {
      const int64_t run_end = begins[r] + runs[r].length;
      const int64_t count = std::min(end, run_end) - begin;
      piece(runs[r], begin - begins[r], count);
      begin += count;
      ++r;
    }
  });
}

// Per-thread scratch for the run table and the offsets, so a call allocates nothing once warm.
// Very large tables are not kept between calls.
struct Scratch {
  std::vector<FlatRun> runs;
  std::vector<int64_t> offsets;
  void trim() {
    constexpr size_t kKeep = size_t{1} << 16;
    if (runs.capacity() > 2 * kKeep + 1) std::vector<FlatRun>().swap(runs);
    if (offsets.capacity() > kKeep) std::vector<int64_t>().swap(offsets);
  }
};

Scratch& scratch() {
  thread_local Scratch instance;
  return instance;
}

// Bytes read + written per element for a (source, destination) dtype pair.
int64_t bytes_moved(int64_t src_code, int64_t dst_code) {
  return element_size(src_code) + element_size(dst_code);
}

// srcs: list of tensors (any shapes); out: [window numel], window at out_offset of the flat space.
template <class List>
void pack_impl(const List& srcs, at::IntArrayRef offsets, const at::Tensor& out,
               int64_t out_offset, double scale, std::vector<FlatRun>& runs) {
  check_pack_args(srcs, offsets, out, out_offset);
  plan_runs_into(runs, srcs, offsets, out_offset, out.numel(), /*fill_gaps=*/true,
                 /*write_tensors=*/false);
  const int64_t out_code = dtype_code(out.scalar_type());
  char* out_data = static_cast<char*>(out.mutable_data_ptr());
  const float scale_f = static_cast<float>(scale);
  const bool scaled = scale != 1.0;
  const bool stream = out.numel() * element_size(out_code) >= kStreamMinBytes;
  // Sources may mix dtypes: the grain counts them all as fp32, the widest.
  for_each_piece(runs, bytes_moved(kFloat32, out_code),
                 [&](const FlatRun& run, int64_t offset, int64_t count) {
    char* dst = out_data + (run.window_begin + offset) * element_size(out_code);
    if (run.tensor_dtype == kZeroFill) {
      std::memset(dst, 0, count * element_size(out_code));  // +0.0 is all-zero bits in every dtype
      return;
    }
    const char* src = run.tensor_data + offset * element_size(run.tensor_dtype);
    convert(run.tensor_dtype, src, out_code, dst, count, scale_f, scaled, stream);
  });
}

// src: [window numel], window at src_offset of the flat space; outs: list of tensors (any shapes).
template <class List>
void unpack_impl(const at::Tensor& src, int64_t src_offset, at::IntArrayRef offsets,
                 const List& outs, std::vector<FlatRun>& runs) {
  check_unpack_args(src, src_offset, offsets, outs);
  plan_runs_into(runs, outs, offsets, src_offset, src.numel(), /*fill_gaps=*/false,
                 /*write_tensors=*/true);
  const int64_t src_code = dtype_code(src.scalar_type());
  const char* src_data = static_cast<const char*>(src.const_data_ptr());
  int64_t written = 0;
  for (const FlatRun& run : runs) written += run.length * element_size(run.tensor_dtype);
  const bool stream = written >= kStreamMinBytes;
  for_each_piece(runs, bytes_moved(src_code, kFloat32),
                 [&](const FlatRun& run, int64_t offset, int64_t count) {
    const char* from = src_data + (run.window_begin + offset) * element_size(src_code);
    char* to = run.tensor_data + offset * element_size(run.tensor_dtype);
    convert(src_code, from, run.tensor_dtype, to, count, 1.0f, false, stream);
  });
}

// Boxed entry points (see boxed_args.h). Stack: srcs, offsets, out, out_offset, scale.
void pack_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  constexpr size_t kArgs = 5;
  const c10::IValue* args = stack->data() + (stack->size() - kArgs);
  const BoxedTensorList srcs{args[0].toListRef()};
  Scratch& s = scratch();
  pack_impl(srcs, boxed_int_list(args[1], s.offsets), args[2].toTensor(), args[3].toInt(),
            args[4].toDouble(), s.runs);
  s.trim();
  drop_boxed_arguments(*stack, kArgs, srcs);
}

// Stack: src, src_offset, offsets, outs.
void unpack_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  constexpr size_t kArgs = 4;
  const c10::IValue* args = stack->data() + (stack->size() - kArgs);
  const BoxedTensorList outs{args[3].toListRef()};
  Scratch& s = scratch();
  unpack_impl(args[0].toTensor(), args[1].toInt(), boxed_int_list(args[2], s.offsets), outs,
              s.runs);
  s.trim();
  drop_boxed_arguments(*stack, kArgs, outs);
}

// shard: any shape, n elements; gathered: [>= (slot + 1) * n]; writes gathered[slot*n, (slot+1)*n).
void cast_into_slot_cpu(const at::Tensor& shard, const at::Tensor& gathered, int64_t slot) {
  check_cast_into_slot_args(shard, gathered, slot);
  const int64_t n = shard.numel();
  const int64_t src_code = dtype_code(shard.scalar_type());
  const int64_t dst_code = dtype_code(gathered.scalar_type());
  const char* src = static_cast<const char*>(shard.const_data_ptr());
  char* dst = static_cast<char*>(gathered.mutable_data_ptr()) + slot * n * element_size(dst_code);
  const int64_t grain = grain_for(bytes_moved(src_code, dst_code));
  const bool stream = n * element_size(dst_code) >= kStreamMinBytes;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    convert(src_code, src + begin * element_size(src_code), dst_code,
            dst + begin * element_size(dst_code), end - begin, 1.0f, false, stream);
  });
}

template <class Src, class Dst, int kMode>
void epilogue_span_in_mode(const typename Src::storage* in, typename Dst::storage* acc, int64_t n,
                           float factor, bool accumulate) {
  if (accumulate) {
    epilogue_loop<Src, Dst, kMode, true>(in, acc, n, factor);
  } else {
    epilogue_loop<Src, Dst, kMode, false>(in, acc, n, factor);
  }
}

template <class Src, class Dst>
void epilogue_span(const void* reduced, void* out, int64_t n, EpilogueDivide divide,
                   bool accumulate) {
  const auto* in = static_cast<const typename Src::storage*>(reduced);
  auto* acc = static_cast<typename Dst::storage*>(out);
  if (divide.mode == kDivide) {
    epilogue_span_in_mode<Src, Dst, kDivide>(in, acc, n, divide.factor, accumulate);
  } else if (divide.mode == kMultiplyByReciprocal) {
    epilogue_span_in_mode<Src, Dst, kMultiplyByReciprocal>(in, acc, n, divide.factor, accumulate);
  } else {
    epilogue_span_in_mode<Src, Dst, kNoDivide>(in, acc, n, divide.factor, accumulate);
  }
}

// reduced: any shape, n elements; out: any shape, n elements (updated in place).
void grad_epilogue_cpu(const at::Tensor& reduced, const at::Tensor& out, double divisor,
                       bool accumulate) {
  check_grad_epilogue_args(reduced, out);
  const int64_t src_code = dtype_code(reduced.scalar_type());
  const int64_t dst_code = dtype_code(out.scalar_type());
  const char* in = static_cast<const char*>(reduced.const_data_ptr());
  char* acc = static_cast<char*>(out.mutable_data_ptr());
  const EpilogueDivide divide = epilogue_divide(divisor);
  // Reads reduced and out, writes out.
  const int64_t grain = grain_for(bytes_moved(src_code, dst_code) + element_size(dst_code));
  at::parallel_for(0, out.numel(), grain, [&](int64_t begin, int64_t end) {
    with_element_type(src_code, [&](auto src_type) {
      with_element_type(dst_code, [&](auto dst_type) {
        epilogue_span<decltype(src_type), decltype(dst_type)>(
            in + begin * element_size(src_code), acc + begin * element_size(dst_code),
            end - begin, divide, accumulate);
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdp_ext, CPU, m) {
  m.impl("pack", torch::CppFunction::makeFromBoxedFunction<&pack_boxed>());
  m.impl("unpack", torch::CppFunction::makeFromBoxedFunction<&unpack_boxed>());
  m.impl("cast_into_slot", &cast_into_slot_cpu);
  m.impl("grad_epilogue", &grad_epilogue_cpu);
}

}  // namespace fsdp_ext
