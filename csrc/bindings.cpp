// The one place that knows Python. Everything else in csrc/ takes raw pointers and sizes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/map.h>

#include <map>
#include <string>

#include "dispatch.h"

namespace nb = nanobind;

NB_MODULE(_cpu, m) {
  m.doc() = "hetmoe CPU expert backend";
  m.def("cpu_features", [] {
    const auto& f = hetmoe::cpu_features();
    return std::map<std::string, bool>{
        {"avx2", f.avx2},
        {"fma", f.fma},
        {"f16c", f.f16c},
        {"avx512f", f.avx512f},
        {"avx512bw", f.avx512bw},
        {"avx512vl", f.avx512vl},
        {"avx512dq", f.avx512dq},
        {"avx512_bf16", f.avx512_bf16},
        {"avx512_vnni", f.avx512_vnni},
        {"amx_tile", f.amx_tile},
        {"amx_bf16", f.amx_bf16},
        {"amx_int8", f.amx_int8},
        {"amx_permitted", f.amx_permitted},
    };
  }, "CPU features this build can use here (CPUID + OS state + AMX permission).");
}
