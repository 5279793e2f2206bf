// CPUID + XCR0 + Linux arch_prctl checks, and HETMOE_AMX_INT4 (asked on every CPU). Nothing here
// needs ISA flags beyond x86-64.
#include "dispatch.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace hetmoe {
namespace {

constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t(edx) << 32) | eax;
}

bool request_amx_permission() {
#if defined(__linux__)
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  uint64_t mask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) != 0) return false;
  return (mask >> kXfeatureXtiledata) & 1;
#else
  return false;
#endif
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1;
  f.fma = (c >> 12) & 1;
  f.f16c = (c >> 29) & 1;
  uint64_t xcr0 = osxsave ? read_xcr0() : 0;
  const bool os_avx = (xcr0 & 0x6) == 0x6;
  f.os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  f.avx2 = os_avx && ((b >> 5) & 1);
  f.fma = f.fma && os_avx;
  f.f16c = f.f16c && os_avx;
  f.avx512f = f.os_avx512 && ((b >> 16) & 1);
  f.avx512dq = f.os_avx512 && ((b >> 17) & 1);
  f.avx512bw = f.os_avx512 && ((b >> 30) & 1);
  f.avx512vl = f.os_avx512 && ((b >> 31) & 1);
  f.avx512_vnni = f.os_avx512 && ((c >> 11) & 1);
  f.avx512_vbmi = f.os_avx512 && ((c >> 1) & 1);
  f.amx_bf16 = os_amx && ((d >> 22) & 1);
  f.amx_tile = os_amx && ((d >> 24) & 1);
  f.amx_int8 = os_amx && ((d >> 25) & 1);
  unsigned a1, b1, c1, d1;
  if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) f.avx512_bf16 = f.os_avx512 && ((a1 >> 5) & 1);
#ifdef HETMOE_AMX_EMULATION
  // testing/amx_emulation.h runs the tile instructions in plain C++ (a developer build); the
  // AMX files' vector code is native, so the emulated AMX still needs what real AMX CPUs have.
  f.amx_tile = f.amx_bf16 = f.amx_int8 = f.amx_permitted = f.avx512_vbmi;
#else
  if (f.amx_tile) f.amx_permitted = request_amx_permission();
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

Isa best_isa() {
  const CpuFeatures& f = cpu_features();
  const bool avx512 = f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512_bf16 &&
                      f.avx512_vnni;
  if (avx512 && f.avx512_vbmi && f.amx_tile && f.amx_bf16 && f.amx_int8 && f.amx_permitted)
    return Isa::kAmx;
  if (avx512) return Isa::kAvx512;
  if (f.avx2 && f.fma) return Isa::kAvx2;
  return Isa::kScalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

Isa parse_isa(const std::string& name) {
  if (name == "auto") return best_isa();
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx}) {
    if (name != isa_name(isa)) continue;
    if (int(isa) > int(best_isa())) {
      static const char* needs[] = {"", "AVX2 + FMA", "AVX-512 F/BW/VL/DQ + BF16 + VNNI",
                                    "AMX tile/bf16/int8 + AVX-512 VBMI with the OS permission (arch_prctl)"};
      throw std::invalid_argument("ISA '" + name + "' was requested but this CPU/OS lacks " +
                                  needs[int(isa)] + "; the best available is '" +
                                  isa_name(best_isa()) + "'");
    }
    return isa;
  }
  throw std::invalid_argument("unknown ISA '" + name +
                              "': expected one of auto, amx, avx512, avx2, scalar");
}

const char* amx_int4_kernel() {
  static const char* const name = [] {
    const char* v = std::getenv("HETMOE_AMX_INT4");
    if (!v || std::strcmp(v, "bf16") == 0) return "bf16";
    if (std::strcmp(v, "i8") == 0) return "i8";
    throw std::invalid_argument("HETMOE_AMX_INT4='" + std::string(v) +
                                "': expected unset, 'bf16' or 'i8' (the AMX int4 kernel)");
  }();
  return name;
}

}  // namespace hetmoe
