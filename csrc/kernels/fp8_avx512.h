// e4m3 codes widened to bf16 in AVX-512 registers (exact: every e4m3 value is a bf16 value), for
// the AVX-512 and AMX fp8 kernels (internal linkage: each includes its own copy).
//   normal (exponent field > 0): bf16 = sign | ((code & 0x7F) << 4) + (120 << 7)  (bias 7 -> 127)
//   subnormal (m * 2^-9, m < 8): one of 8 values, looked up with a masked vpermw.
// NaN codes (0x7F / 0xFF) would read as +-480: the loader refuses them.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "layout/bf16.h"
#include "layout/fp8.h"

namespace hetmoe {
namespace {

// bf16 of the e4m3 subnormals m * 2^-9 for m = 0..7 (the rest of the 32 entries unused).
inline __m512i fp8_subnormal_table() {
  struct Table {
    alignas(64) uint16_t v[32] = {};
    Table() {
      for (int m = 0; m < 8; ++m) v[m] = float_to_bf16(fp8_e4m3_to_float(uint8_t(m)));
    }
  };
  static const Table table;
  return _mm512_load_si512(table.v);
}

// 32 codes (one per 16-bit lane of `codes`, zero-extended) -> 32 bf16 in the same lanes.
inline __m512i fp8_lanes_to_bf16(__m512i codes, __m512i subnormals) {
  const __m512i mag = _mm512_and_si512(codes, _mm512_set1_epi16(0x7F));
  __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag,
                                    subnormals);
  // v | (codes << 8 & 0x8000): the sign.
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(codes, 8),
                                   _mm512_set1_epi16(int16_t(0x8000)), 0xF8);
}

// 32 consecutive codes at p -> 32 bf16 (the fp8 block order widens to the bf16 block order).
inline __m512i fp8x32_to_bf16(const uint8_t* p, __m512i subnormals) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return fp8_lanes_to_bf16(_mm512_cvtepu8_epi16(bytes), subnormals);
}

}  // namespace
}  // namespace hetmoe
