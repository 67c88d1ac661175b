// Argument checks for the four ops, shared by the CPU and CUDA host code.
//
// They mirror fsdp_ext/ops/checks.py (same conditions, same wording, same ValueError type through
// TORCH_CHECK_VALUE) and name the offending argument. Every check runs before any write, so a bad
// call fails loudly instead of writing out of bounds. Parts of a tensor outside the window are not
// errors: the kernels clip them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#define FSDP_EXT_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

#define CHECK_FLOAT_DTYPE(t, name)                                                       \
  FSDP_EXT_CHECK(::fsdp_ext::is_float_dtype((t).scalar_type()), name, ": dtype ",        \
                 (t).scalar_type(), " is not one of fp32/bf16/fp16")
#define CHECK_DEVICE(t, name, expected) \
  FSDP_EXT_CHECK((t).device() == (expected), name, ": on ", (t).device(), ", expected ", expected)
#define CHECK_CONTIGUOUS(t, name) FSDP_EXT_CHECK((t).is_contiguous(), name, ": must be contiguous")
#define CHECK_1D(t, name) FSDP_EXT_CHECK((t).dim() == 1, name, ": must be 1-D")
#define CHECK_NON_NEGATIVE(v, name) FSDP_EXT_CHECK((v) >= 0, name, ": must be >= 0")
#define CHECK_TENSOR(t, name, expected_device) \
  do {                                         \
    CHECK_FLOAT_DTYPE(t, name);                \
    CHECK_DEVICE(t, name, expected_device);    \
    CHECK_CONTIGUOUS(t, name);                 \
  } while (0)
// start + numel must be representable, so that no later index computation overflows.
#define CHECK_END_FITS(start, numel, name)                                                   \
  FSDP_EXT_CHECK((start) <= std::numeric_limits<int64_t>::max() - (numel), name,             \
                 ": offset ", start, " + ", numel, " elements overflows int64")

namespace fsdp_ext {

inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

inline std::string indexed_name(const char* list_name, size_t index) {
  return std::string(list_name) + "[" + std::to_string(index) + "]";
}

// The list checks below take any list type with size() and operator[] giving a const at::Tensor&:
// at::TensorList, or a view of a boxed Tensor[] argument (no copies, so no refcount traffic).

// The tensors' flat ranges [offset, offset + numel) must not overlap; empty ranges never do.
template <class List>
void check_disjoint(const List& tensors, at::IntArrayRef offsets, const char* list_name) {
  std::vector<std::tuple<int64_t, int64_t, size_t>> ranges;  // (start, end, index)
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() > 0) {
      ranges.emplace_back(offsets[i], offsets[i] + tensors[i].numel(), i);
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 1; k < ranges.size(); ++k) {
    FSDP_EXT_CHECK(std::get<0>(ranges[k]) >= std::get<1>(ranges[k - 1]),
                   indexed_name(list_name, std::get<2>(ranges[k])), " overlaps ",
                   indexed_name(list_name, std::get<2>(ranges[k - 1])), " in the flat buffer");
  }
}

// Raises the error for list element i, which failed the combined test in check_tensor_list: the
// checks one by one, each naming the element. Out of line, so the loop that calls it stays tight.
template <class List>
C10_NOINLINE void raise_bad_element(const List& tensors, at::IntArrayRef offsets, size_t i,
                                    const char* list_name, const c10::Device& device) {
  const std::string name = indexed_name(list_name, i);
  CHECK_TENSOR(tensors[i], name, device);
  CHECK_NON_NEGATIVE(offsets[i], indexed_name("offsets", i));
  CHECK_END_FITS(offsets[i], tensors[i].numel(), indexed_name("offsets", i));
}

// Checks shared by pack (the list is srcs) and unpack (the list is outs). One pass reads each
// tensor's fields once; names are built only on failure. When the non-empty ranges already come
// in increasing flat order (the usual layout) that pass also proves them disjoint; otherwise they
// are sorted and checked pairwise.
template <class List>
void check_tensor_list(const List& tensors, at::IntArrayRef offsets, const char* list_name,
                       const c10::Device& device) {
  FSDP_EXT_CHECK(tensors.size() == offsets.size(), list_name, " has ", tensors.size(),
                 " tensors but offsets has ", offsets.size());
  bool in_flat_order = true;
  int64_t previous_end = 0;  // end of the last non-empty range seen
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::TensorImpl* t = tensors[i].unsafeGetTensorImpl();
    const int64_t offset = offsets[i];
    const int64_t numel = t->numel();
    const bool ok = is_float_dtype(t->dtype().toScalarType()) && t->device() == device &&
                    t->is_contiguous() && offset >= 0 &&
                    offset <= std::numeric_limits<int64_t>::max() - numel;
    if (!ok) raise_bad_element(tensors, offsets, i, list_name, device);
    if (numel > 0) {
      in_flat_order = in_flat_order && offset >= previous_end;
      previous_end = offset + numel;
    }
  }
  if (!in_flat_order) check_disjoint(tensors, offsets, list_name);
}

// srcs: list of tensors of any shape; out: [window numel], the window starts at out_offset.
template <class List>
void check_pack_args(const List& srcs, at::IntArrayRef offsets, const at::Tensor& out,
                     int64_t out_offset) {
  CHECK_TENSOR(out, "out", out.device());
  CHECK_1D(out, "out");
  CHECK_NON_NEGATIVE(out_offset, "out_offset");
  CHECK_END_FITS(out_offset, out.numel(), "out_offset");
  check_tensor_list(srcs, offsets, "srcs", out.device());
}

// src: [window numel], the window starts at src_offset; outs: list of tensors of any shape.
template <class List>
void check_unpack_args(const at::Tensor& src, int64_t src_offset, at::IntArrayRef offsets,
                       const List& outs) {
  CHECK_TENSOR(src, "src", src.device());
  CHECK_1D(src, "src");
  CHECK_NON_NEGATIVE(src_offset, "src_offset");
  CHECK_END_FITS(src_offset, src.numel(), "src_offset");
  check_tensor_list(outs, offsets, "outs", src.device());
}

// shard: any shape, n elements; gathered: [world * n] (at least (slot + 1) * n).
inline void check_cast_into_slot_args(const at::Tensor& shard, const at::Tensor& gathered,
                                      int64_t slot) {
  CHECK_TENSOR(shard, "shard", gathered.device());
  CHECK_TENSOR(gathered, "gathered", gathered.device());
  // The reference slices gathered[slot*n:(slot+1)*n] along dim 0, which is a flat slot only in 1-D.
  CHECK_1D(gathered, "gathered");
  CHECK_NON_NEGATIVE(slot, "slot");
  const int64_t n = shard.numel();
  // (slot + 1) * n <= gathered.numel(), written so that a huge slot cannot overflow.
  FSDP_EXT_CHECK(n == 0 || slot < gathered.numel() / n, "gathered: ", gathered.numel(),
                 " elements cannot hold slot ", slot, " of ", n);
}

// reduced: any shape, n elements; out: any shape, n elements.
inline void check_grad_epilogue_args(const at::Tensor& reduced, const at::Tensor& out) {
  CHECK_TENSOR(reduced, "reduced", out.device());
  CHECK_TENSOR(out, "out", out.device());
  FSDP_EXT_CHECK(reduced.numel() == out.numel(), "reduced has ", reduced.numel(),
                 " elements but out has ", out.numel());
}

}  // namespace fsdp_ext
