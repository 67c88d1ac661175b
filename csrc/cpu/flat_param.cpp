// CPU kernels for the four ops (schemas in csrc/ops.cpp, semantics in fsdp_ext/ops/reference.py).
//
// One call handles any number of tensors: the host plan (flat_plan.h) lists the runs of the window,
// and at::parallel_for splits the runs' total length into equal pieces, so the work is balanced by
// elements moved rather than by tensor count. Same-dtype unscaled runs are memcpy; casts go through
// the shared bit-exact conversions of flat_layout.h in plain loops the compiler vectorizes.
#include "../checks.h"
#include "../flat_layout.h"
#include "../flat_plan.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace fsdp_ext {
namespace {

// Below this many elements per task, starting a thread costs more than the copy it would take over.
constexpr int64_t kGrainElements = 1 << 15;

// The fp32->fp16 rounding shifts each lane by its own amount, which x86 vectorizes only from AVX2
// on: build the element loops for AVX2 and for the baseline, chosen once at load time (ifunc).
#if defined(__x86_64__) && defined(__linux__)
#define FSDP_EXT_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FSDP_EXT_VECTOR_CLONES
#endif

// The element loops: one instantiation per (dtypes, flags), so each body is branch-free.
template <class Src, class Dst, bool kScaled>
FSDP_EXT_VECTOR_CLONES void convert_loop(const typename Src::storage* in,
                                         typename Dst::storage* out, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = convert_element<Src, Dst>(in[i], scale, kScaled);
}

template <class Src, class Dst, bool kScaled, bool kAccumulate>
FSDP_EXT_VECTOR_CLONES void epilogue_loop(const typename Src::storage* in,
                                          typename Dst::storage* acc, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    acc[i] = epilogue_element<Src, Dst>(in[i], acc[i], scale, kScaled, kAccumulate);
  }
}

template <class Src, class Dst>
void convert_span(const void* src, void* dst, int64_t n, float scale, bool scaled) {
  const auto* in = static_cast<const typename Src::storage*>(src);
  auto* out = static_cast<typename Dst::storage*>(dst);
  if constexpr (std::is_same_v<Src, Dst>) {
    if (!scaled) {
      if (in != out) std::memcpy(out, in, n * sizeof(*out));
      return;
    }
  }
  if (scaled) {
    convert_loop<Src, Dst, true>(in, out, n, scale);
  } else {
    convert_loop<Src, Dst, false>(in, out, n, scale);
  }
}

// n elements from src (dtype code src_code) to dst (dst_code): cast(src * scale).
void convert(int64_t src_code, const void* src, int64_t dst_code, void* dst, int64_t n,
             float scale, bool scaled) {
  with_element_type(src_code, [&](auto src_type) {
    with_element_type(dst_code, [&](auto dst_type) {
      convert_span<decltype(src_type), decltype(dst_type)>(src, dst, n, scale, scaled);
    });
  });
}

// Calls piece(run, offset_in_run, count) over all runs, in parallel pieces of equal length.
template <class Piece>
void for_each_piece(const std::vector<FlatRun>& runs, const Piece& piece) {
  if (runs.empty()) return;
  const std::vector<int64_t> begins = work_begins(runs);
  const int64_t total = begins.back() + runs.back().length;
  at::parallel_for(0, total, kGrainElements, [&](int64_t begin, int64_t end) {
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

// srcs: list of tensors (any shapes); out: [window numel], window at out_offset of the flat space.
void pack_cpu(at::TensorList srcs, at::IntArrayRef offsets, const at::Tensor& out,
              int64_t out_offset, double scale) {
  check_pack_args(srcs, offsets, out, out_offset);
  const std::vector<FlatRun> runs = plan_runs(srcs, offsets, out_offset, out.numel(), true);
  const int64_t out_code = dtype_code(out.scalar_type());
  char* out_data = static_cast<char*>(out.data_ptr());
  const float scale_f = static_cast<float>(scale);
  const bool scaled = scale != 1.0;
  for_each_piece(runs, [&](const FlatRun& run, int64_t offset, int64_t count) {
    char* dst = out_data + (run.window_begin + offset) * element_size(out_code);
    if (run.tensor_dtype == kZeroFill) {
      std::memset(dst, 0, count * element_size(out_code));  // +0.0 is all-zero bits in every dtype
      return;
    }
    const char* src = run.tensor_data + offset * element_size(run.tensor_dtype);
    convert(run.tensor_dtype, src, out_code, dst, count, scale_f, scaled);
  });
}

// src: [window numel], window at src_offset of the flat space; outs: list of tensors (any shapes).
void unpack_cpu(const at::Tensor& src, int64_t src_offset, at::IntArrayRef offsets,
                at::TensorList outs) {
  check_unpack_args(src, src_offset, offsets, outs);
  const std::vector<FlatRun> runs = plan_runs(outs, offsets, src_offset, src.numel(), false);
  const int64_t src_code = dtype_code(src.scalar_type());
  const char* src_data = static_cast<const char*>(src.data_ptr());
  for_each_piece(runs, [&](const FlatRun& run, int64_t offset, int64_t count) {
    const char* from = src_data + (run.window_begin + offset) * element_size(src_code);
    char* to = run.tensor_data + offset * element_size(run.tensor_dtype);
    convert(src_code, from, run.tensor_dtype, to, count, 1.0f, false);
  });
}

// shard: any shape, n elements; gathered: [>= (slot + 1) * n]; writes gathered[slot*n, (slot+1)*n).
void cast_into_slot_cpu(const at::Tensor& shard, const at::Tensor& gathered, int64_t slot) {
  check_cast_into_slot_args(shard, gathered, slot);
  const int64_t n = shard.numel();
  const int64_t src_code = dtype_code(shard.scalar_type());
  const int64_t dst_code = dtype_code(gathered.scalar_type());
  const char* src = static_cast<const char*>(shard.data_ptr());
  char* dst = static_cast<char*>(gathered.data_ptr()) + slot * n * element_size(dst_code);
  at::parallel_for(0, n, kGrainElements, [&](int64_t begin, int64_t end) {
    convert(src_code, src + begin * element_size(src_code), dst_code,
            dst + begin * element_size(dst_code), end - begin, 1.0f, false);
  });
}

template <class Src, class Dst>
void epilogue_span(const void* reduced, void* out, int64_t n, float scale, bool scaled,
                   bool accumulate) {
  const auto* in = static_cast<const typename Src::storage*>(reduced);
  auto* acc = static_cast<typename Dst::storage*>(out);
  if (scaled && accumulate) epilogue_loop<Src, Dst, true, true>(in, acc, n, scale);
  if (scaled && !accumulate) epilogue_loop<Src, Dst, true, false>(in, acc, n, scale);
  if (!scaled && accumulate) epilogue_loop<Src, Dst, false, true>(in, acc, n, scale);
  if (!scaled && !accumulate) epilogue_loop<Src, Dst, false, false>(in, acc, n, scale);
}

// reduced: any shape, n elements; out: any shape, n elements (updated in place).
void grad_epilogue_cpu(const at::Tensor& reduced, const at::Tensor& out, double scale,
                       bool accumulate) {
  check_grad_epilogue_args(reduced, out);
  const int64_t src_code = dtype_code(reduced.scalar_type());
  const int64_t dst_code = dtype_code(out.scalar_type());
  const char* in = static_cast<const char*>(reduced.data_ptr());
  char* acc = static_cast<char*>(out.data_ptr());
  const float scale_f = static_cast<float>(scale);
  const bool scaled = scale != 1.0;
  at::parallel_for(0, out.numel(), kGrainElements, [&](int64_t begin, int64_t end) {
    with_element_type(src_code, [&](auto src_type) {
      with_element_type(dst_code, [&](auto dst_type) {
        epilogue_span<decltype(src_type), decltype(dst_type)>(
            in + begin * element_size(src_code), acc + begin * element_size(dst_code),
            end - begin, scale_f, scaled, accumulate);
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdp_ext, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("unpack", &unpack_cpu);
  m.impl("cast_into_slot", &cast_into_slot_cpu);
  m.impl("grad_epilogue", &grad_epilogue_cpu);
}

}  // namespace fsdp_ext
