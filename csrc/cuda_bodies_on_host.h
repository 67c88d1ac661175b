// The CUDA kernels' bodies (kernel_bodies.h) run on the host over their whole grid, for the tests;
// see csrc/cpu/cuda_bodies_on_host.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace fsdp_ext {

void register_cuda_bodies_on_host(pybind11::module_& module);

}  // namespace fsdp_ext
