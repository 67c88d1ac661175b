// Host-side planning shared by the CPU and CUDA kernels: which runs of a flat window map onto
// which tensor.
//
// pack and unpack both move data between one flat window (out / src) and many tensors. The plan is
// a list of runs sorted by window position; each run is one contiguous piece of one tensor (clipped
// to the window), or, for pack, a gap that no tensor covers and that must be zero-filled. Kernels
// then split the runs' total length into equal pieces of work, so one call balances the same way
// for 1000 tiny tensors and for one huge tensor.
#pragma once

#include "flat_layout.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fsdp_ext {

inline int64_t dtype_code(at::ScalarType t) {
  return t == at::kFloat ? kFloat32 : (t == at::kBFloat16 ? kBFloat16 : kFloat16);
}

struct FlatRun {
  int64_t window_begin;  // first element of the run, counted from the start of the window
  int64_t length;        // elements, > 0
  char* tensor_data;     // the run's first element inside its tensor; nullptr for a zero fill
  int64_t tensor_dtype;  // dtype code of that tensor; kZeroFill for a zero fill
};

// Runs for `tensors` (tensor i at flat offsets[i]) inside the window [window_begin, window_begin +
// window_numel). With fill_gaps the runs tile the whole window, gaps becoming kZeroFill runs.
// Arguments must have passed checks.h (disjoint ranges, no overflow).
inline std::vector<FlatRun> plan_runs(at::TensorList tensors,
                                      at::IntArrayRef offsets, int64_t window_begin,
                                      int64_t window_numel, bool fill_gaps) {
  const int64_t window_end = window_begin + window_numel;
  std::vector<FlatRun> covered;
  covered.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const FlatSpan span =
        clip_to_window(offsets[i], tensors[i].numel(), window_begin, window_end);
    if (span.empty()) continue;
    const int64_t code = dtype_code(tensors[i].scalar_type());
    char* first = static_cast<char*>(tensors[i].data_ptr()) +
                  (span.begin - offsets[i]) * element_size(code);
    covered.push_back({span.begin - window_begin, span.size(), first, code});
  }
  std::sort(covered.begin(), covered.end(), [](const FlatRun& a, const FlatRun& b) {
    return a.window_begin < b.window_begin;
  });
  if (!fill_gaps) return covered;

  std::vector<FlatRun> tiled;
  tiled.reserve(2 * covered.size() + 1);
  int64_t position = 0;  // everything before it is planned
  for (const FlatRun& run : covered) {
    if (run.window_begin > position) {
      tiled.push_back({position, run.window_begin - position, nullptr, kZeroFill});
    }
    tiled.push_back(run);
    position = run.window_begin + run.length;
  }
  if (window_numel > position) {
    tiled.push_back({position, window_numel - position, nullptr, kZeroFill});
  }
  return tiled;
}

// work_begins[i] = total length of runs before run i: where run i starts in the pieces of work.
inline std::vector<int64_t> work_begins(const std::vector<FlatRun>& runs) {
  std::vector<int64_t> begins(runs.size());
  int64_t total = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    begins[i] = total;
    total += runs[i].length;
  }
  return begins;
}

}  // namespace fsdp_ext
