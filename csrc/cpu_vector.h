// Which code the CPU kernels run: the AVX2 (and F16C) vector paths where the CPU has them, or the
// scalar ones. Both give the same bits; the switch exists so that one machine tests both.
//
//   FSDP_EXT_CPU_VECTOR   unset or "auto": vector paths where the CPU has AVX2 (and F16C where a
//                         path needs it); "0": scalar paths only; "1": vector paths, and the
//                         first kernel call raises if the CPU lacks AVX2 or F16C
//
// Read once, at the first kernel call that asks, for the whole process. Every dispatch between
// the two paths counts which one it took (cpu_vector_paths() in Python: the tests assert on it).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace fsdp_ext {

// Whether this dispatch takes the AVX2 path (needs_f16c: the path also uses F16C), counted.
bool use_avx2(bool needs_f16c = false);

// fsdp_ext._C.cpu_vector_paths(): the switch, the CPU's features and the counts.
void register_cpu_vector(pybind11::module_& module);

}  // namespace fsdp_ext
