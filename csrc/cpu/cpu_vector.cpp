// The CPU vector switch (cpu_vector.h): the environment read once, the CPU's features, and the
// per-path dispatch counters, exposed as fsdp_ext._C.cpu_vector_paths().
#include "../cpu_vector.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace fsdp_ext {
namespace {

struct Features {
  bool avx2 = false;
  bool f16c = false;
};

Features cpu_features() {
  Features f;
#if defined(__x86_64__) && defined(__GNUC__)
  f.avx2 = __builtin_cpu_supports("avx2");
  f.f16c = f.avx2 && __builtin_cpu_supports("f16c");
#endif
  return f;
}

// "auto", "0" or "1"; anything else is refused naming the variable.
std::string requested_mode() {
  const char* value = std::getenv("FSDP_EXT_CPU_VECTOR");
  std::string mode = value == nullptr || *value == '\0' ? "auto" : value;
  TORCH_CHECK(mode == "auto" || mode == "0" || mode == "1",
              "FSDP_EXT_CPU_VECTOR must be auto, 0 or 1, not '", mode, "'");
  return mode;
}

struct Switch {
  std::string mode;
  Features cpu;
  bool avx2 = false;  // the vector paths that need AVX2 only
  bool f16c = false;  // those that need F16C too
};

const Switch& the_switch() {
  static const Switch s = [] {
    Switch out;
    out.mode = requested_mode();
    out.cpu = cpu_features();
    TORCH_CHECK(out.mode != "1" || (out.cpu.avx2 && out.cpu.f16c),
                "FSDP_EXT_CPU_VECTOR=1 asks for the AVX2 and F16C paths, which this CPU lacks "
                "(AVX2: ", out.cpu.avx2, ", F16C: ", out.cpu.f16c, ")");
    out.avx2 = out.mode != "0" && out.cpu.avx2;
    out.f16c = out.avx2 && out.cpu.f16c;
    return out;
  }();
  return s;
}

std::atomic<int64_t> vector_calls{0};
std::atomic<int64_t> scalar_calls{0};

pybind11::dict cpu_vector_paths() {
  const Switch& s = the_switch();
  pybind11::dict out;
  out["mode"] = s.mode;
  out["cpu_avx2"] = s.cpu.avx2;
  out["cpu_f16c"] = s.cpu.f16c;
  out["avx2"] = s.avx2;
  out["f16c"] = s.f16c;
  out["vector_calls"] = vector_calls.load(std::memory_order_relaxed);
  out["scalar_calls"] = scalar_calls.load(std::memory_order_relaxed);
  return out;
}

}  // namespace

bool use_avx2(bool needs_f16c) {
  const Switch& s = the_switch();
  const bool vector = needs_f16c ? s.f16c : s.avx2;
  (vector ? vector_calls : scalar_calls).fetch_add(1, std::memory_order_relaxed);
  return vector;
}

void register_cpu_vector(pybind11::module_& module) {
  module.def("cpu_vector_paths", &cpu_vector_paths,
             "The CPU kernels' vector switch (FSDP_EXT_CPU_VECTOR, read once), the CPU's "
             "features, and how many dispatches took the AVX2 and the scalar paths so far.");
}

}  // namespace fsdp_ext
