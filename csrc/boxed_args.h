// Reading the arguments of a boxed kernel in place, and dropping them with one GIL acquisition.
//
// pack and unpack take a Tensor[] of, typically, hundreds or thousands of tensors. Their CPU
// kernels are registered boxed, for two per-tensor costs that the unboxed path cannot avoid:
//  - the unboxed wrapper copies the boxed list into a std::vector<at::Tensor> (one atomic
//    increment and decrement per tensor); BoxedTensorList reads the tensors where they are;
//  - a call from Python converts each Python tensor into the stack's list, and when the stack is
//    dropped (inside the dispatcher, with the GIL released) each tensor's last C++ reference goes
//    away, which c10 answers by handing the reference back to the tensor's Python object: one GIL
//    acquisition per tensor. drop_boxed_arguments takes the GIL once for all of them instead.
#pragma once

#include <Python.h>  // first, as Python requires

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <torch/version.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fsdp_ext {

// The elements of a boxed Tensor[] argument, as a list of const at::Tensor& (no copies).
struct BoxedTensorList {
  c10::ArrayRef<c10::IValue> items;
  size_t size() const { return items.size(); }
  const at::Tensor& operator[](size_t i) const { return items[i].toTensor(); }
};

// The elements of a boxed int[] argument, copied into `scratch` (reused between calls).
inline at::IntArrayRef boxed_int_list(const c10::IValue& list, std::vector<int64_t>& scratch) {
  const c10::ArrayRef<c10::IValue> items = list.toListRef();
  scratch.resize(items.size());
  for (size_t i = 0; i < items.size(); ++i) scratch[i] = items[i].toInt();
  return scratch;
}

// True when dropping the stack's reference to some tensor of `list` would release a Python object's
// last C++ reference: that release takes the GIL (see c10::intrusive_ptr::reset_not_null_).
// The Python-object slot is internal API that changes between releases: it is read only with the
// release this was written and tested against; other releases always take the GIL once around the
// drop, which is correct, and costs one acquisition per call where none was needed.
inline bool releases_python_references(const BoxedTensorList& list) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 14
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    if (t.use_count() <= 2 && t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj() != nullptr) {
      return true;
    }
  }
  return false;
#else
  (void)list;
  return true;
#endif
}

// Pops the kernel's `count` arguments off the stack. When that hands tensors back to their Python
// objects, the GIL is taken once around the whole drop (each hand-back then finds it held), rather
// than once per tensor; nothing else runs under it.
inline void drop_boxed_arguments(torch::jit::Stack& stack, size_t count,
                                 const BoxedTensorList& list) {
  if (list.size() > 1 && Py_IsInitialized() && releases_python_references(list)) {
    const PyGILState_STATE gil = PyGILState_Ensure();
    torch::jit::drop(stack, count);
    PyGILState_Release(gil);
    return;
  }
  torch::jit::drop(stack, count);
}

}  // namespace fsdp_ext
