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
#include "kernel_bodies.h"

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
// window_numel), written into `runs` (its old contents are dropped; callers may reuse it to avoid an
// allocation per call). With fill_gaps the runs tile the whole window, gaps becoming kZeroFill
// runs. write_tensors says whether the kernel writes the tensors (unpack) or only reads them
// (pack: read-only data pointers, so a copy-on-write input is not materialized). `List` is any
// list with size() and operator[] giving a const at::Tensor& (see checks.h). Arguments must have
// passed checks.h (disjoint ranges, no overflow).
template <class List>
void plan_runs_into(std::vector<FlatRun>& runs, const List& tensors, at::IntArrayRef offsets,
                    int64_t window_begin, int64_t window_numel, bool fill_gaps,
                    bool write_tensors) {
  const int64_t window_end = window_begin + window_numel;
  runs.clear();
  runs.reserve(fill_gaps ? 2 * tensors.size() + 1 : tensors.size());
  bool sorted = true;
  int64_t position = 0;  // with fill_gaps: everything before it is planned (while sorted)
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::TensorImpl* t = tensors[i].unsafeGetTensorImpl();
    const FlatSpan span = clip_to_window(offsets[i], t->numel(), window_begin, window_end);
    if (span.empty()) continue;
    const int64_t code = dtype_code(t->dtype().toScalarType());
    const void* data = write_tensors ? tensors[i].mutable_data_ptr() : tensors[i].const_data_ptr();
    char* first = static_cast<char*>(const_cast<void*>(data)) +
                  (span.begin - offsets[i]) * element_size(code);
    const int64_t begin = span.begin - window_begin;
    // Runs are disjoint, so increasing starts mean the gaps can be planned in this same pass.
    sorted = sorted && (runs.empty() || begin > runs.back().window_begin);
    if (fill_gaps && sorted && begin > position) {
      runs.push_back({position, begin - position, nullptr, kZeroFill});
    }
    runs.push_back({begin, span.size(), first, code});
    position = begin + span.size();
  }
  if (!sorted) {
    // Offsets out of flat order: sort the covered runs, then plan the gaps between them.
    runs.erase(std::remove_if(runs.begin(), runs.end(),
                              [](const FlatRun& run) { return run.tensor_dtype == kZeroFill; }),
               runs.end());
    std::sort(runs.begin(), runs.end(), [](const FlatRun& a, const FlatRun& b) {
      return a.window_begin < b.window_begin;
    });
    if (!fill_gaps) return;
    std::vector<FlatRun> covered;
    covered.swap(runs);
    position = 0;
    for (const FlatRun& run : covered) {
      if (run.window_begin > position) {
        runs.push_back({position, run.window_begin - position, nullptr, kZeroFill});
      }
      runs.push_back(run);
      position = run.window_begin + run.length;
    }
  }
  if (fill_gaps && window_numel > position) {
    runs.push_back({position, window_numel - position, nullptr, kZeroFill});
  }
}

// The same, returning a new vector; pack reads its tensors (fill_gaps), unpack writes them.
template <class List>
std::vector<FlatRun> plan_runs(const List& tensors, at::IntArrayRef offsets, int64_t window_begin,
                               int64_t window_numel, bool fill_gaps) {
  std::vector<FlatRun> runs;
  plan_runs_into(runs, tensors, offsets, window_begin, window_numel, fill_gaps,
                 /*write_tensors=*/!fill_gaps);
  return runs;
}

// The table flat_runs_block reads, five int64 columns of runs.size() entries one after another
// (first_block | window_begin | length | tensor_address | tensor_dtype), written into `columns`;
// returns the number of blocks of the grid (each run gets ceil(length / kElementsPerBlock)).
inline int64_t fill_run_table(const std::vector<FlatRun>& runs, int64_t* columns) {
  const int64_t count = static_cast<int64_t>(runs.size());
  int64_t blocks = 0;
  for (int64_t i = 0; i < count; ++i) {
    columns[i] = blocks;
    columns[count + i] = runs[i].window_begin;
    columns[2 * count + i] = runs[i].length;
    columns[3 * count + i] = reinterpret_cast<int64_t>(runs[i].tensor_data);
    columns[4 * count + i] = runs[i].tensor_dtype;
    blocks += blocks_for(runs[i].length);
  }
  return blocks;
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
