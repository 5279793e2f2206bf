// CPU feature detection and kernel ISA choice, decided once per process.
#pragma once

#include <string>

namespace hetmoe {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512_bf16 = false;
  bool avx512_vnni = false;
  bool avx512_vbmi = false;  // byte permutes: the AMX int4 kernel's widening (every AMX CPU has it)
  bool amx_tile = false;
  bool amx_bf16 = false;
  bool amx_int8 = false;
  bool os_avx512 = false;     // XCR0 enables the zmm/opmask state
  bool amx_permitted = false; // the kernel granted XTILEDATA via arch_prctl
};

// What this CPU and OS can run; the AMX permission request is made on the first call.
const CpuFeatures& cpu_features();

// Kernel families, ordered: a cap of kAvx512 allows scalar, avx2 and avx512.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

// The best family this CPU and OS can run (AMX only with the OS permission granted).
Isa best_isa();

// "auto" -> best_isa(); "amx" | "avx512" | "avx2" | "scalar" -> that family, or
// std::invalid_argument naming what the CPU lacks / the accepted names.
Isa parse_isa(const std::string& name);

const char* isa_name(Isa isa);

// The AMX int4 kernel amx_kernels() uses: "bf16" (amx_gemm_int4, the default) or "i8"
// (amx_gemm_int4_i8), from the environment variable HETMOE_AMX_INT4 (unset, "bf16" or "i8"),
// read once (thread-safe); any other value is std::invalid_argument naming the variable. Here,
// not in the AMX-flagged amx.cpp: tests, reports and layer construction ask on every CPU.
const char* amx_int4_kernel();

}  // namespace hetmoe
