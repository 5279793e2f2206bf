// bf16 <-> fp32 conversions for baseline (non-ISA) code.
#pragma once

#include <cstdint>
#include <cstring>

namespace hetmoe {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as the hardware conversions do.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return uint16_t(bits >> 16);
}

}  // namespace hetmoe
