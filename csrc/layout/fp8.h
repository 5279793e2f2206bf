// float8 e4m3 (OCP "fn": no infinities, NaN = 0x7F / 0xFF) decoded exactly, for baseline code.
// Every e4m3 value is exact in bf16 (3 mantissa bits; exponents 2^-9 .. 2^8), so the kernels widen
// the codes to bf16 with no rounding. NaN codes never reach them: the loader refuses them.
#pragma once

#include <cmath>
#include <cstdint>

namespace hetmoe {

inline float fp8_e4m3_to_float(uint8_t code) {
  const int e = (code >> 3) & 0xF, m = code & 7;
  // Subnormals: m * 2^-9; normals: (1 + m/8) * 2^(e - 7).
  const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
  return code & 0x80 ? -mag : mag;
}

}  // namespace hetmoe
