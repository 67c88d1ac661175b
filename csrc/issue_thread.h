// The CPU issue thread for all-gathers (copy-in, then broadcasts); see csrc/cpu/issue_thread.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace fsdp_ext {

void register_issue_thread(pybind11::module_& module);

}  // namespace fsdp_ext
