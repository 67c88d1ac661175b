// A small cache of large host blocks for the storages the runtime frees and refills every unit
// (gathered parameters, packed gradients); see csrc/cpu/storage_cache.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace fsdp_ext {

void register_storage_cache(pybind11::module_& module);

}  // namespace fsdp_ext
