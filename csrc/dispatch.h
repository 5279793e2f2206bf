// CPU feature detection, decided once per process.
#pragma once

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
  bool amx_tile = false;
  bool amx_bf16 = false;
  bool amx_int8 = false;
  bool os_avx512 = false;     // XCR0 enables the zmm/opmask state
  bool amx_permitted = false; // the kernel granted XTILEDATA via arch_prctl
};

// What this CPU and OS can run; the AMX permission request is made on the first call.
const CpuFeatures& cpu_features();

}  // namespace hetmoe
