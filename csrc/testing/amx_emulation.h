// AMX tile instructions in plain C++ for machines without AMX: a build with the CMake option
// HETMOE_AMX_EMULATION=ON force-includes this header into the amx*.cpp kernels and reports AMX
// as available (dispatch.cpp), so their tile loops, layouts and fix-ups run — slowly — and the
// AMX tests check them on any AVX-512 machine. Speed means nothing in such a build; it is never
// the shipped one.
//
// Semantics (Intel SDM, AMX): 8 tiles of up to 16 rows x 64 bytes shaped by the loaded config;
// tdpbf16ps C[m][n] += sum_k A[m][2k] B[k][n][0] + A[m][2k+1] B[k][n][1] (bf16 -> fp32), tdpbusd
// C[m][n] += sum_k sum_i u8(A[m][4k+i]) s8(B[k][n][i]) (int32). The products are summed in float
// / int32 here in k order (the hardware's fp32 rounding order is not modelled: the tests'
// tolerances cover bf16 accumulation anyway).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace hetmoe::amx_emulation {

struct Tiles {
  alignas(64) uint8_t data[8][1024];
  int rows[8] = {};
  int colsb[8] = {};
};

inline Tiles& tiles() {
  thread_local Tiles t;
  return t;
}

// The 64-byte config: palette, start row, reserved, colsb[16] (uint16 at 16), rows[16] at 48.
inline void loadconfig(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  Tiles& t = tiles();
  for (int i = 0; i < 8; ++i) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * i, 2);
    t.colsb[i] = colsb;
    t.rows[i] = c[48 + i];
  }
}

inline void release() {
  Tiles& t = tiles();
  for (int i = 0; i < 8; ++i) t.rows[i] = t.colsb[i] = 0;
}

inline void zero(int i) { std::memset(tiles().data[i], 0, 1024); }

inline void loadd(int i, const void* base, long stride) {
  Tiles& t = tiles();
  const uint8_t* p = static_cast<const uint8_t*>(base);
  std::memset(t.data[i], 0, 1024);
  for (int r = 0; r < t.rows[i]; ++r) std::memcpy(t.data[i] + r * 64, p + r * stride, t.colsb[i]);
}

inline void stored(int i, void* base, long stride) {
  Tiles& t = tiles();
  uint8_t* p = static_cast<uint8_t*>(base);
  for (int r = 0; r < t.rows[i]; ++r) std::memcpy(p + r * stride, t.data[i] + r * 64, t.colsb[i]);
}

inline float bf16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// C[m][n] (Acc: float or int32) += term(4 bytes k of A's row m, 4 bytes n of B's row k), in k
// order, over C's rows and columns and A's 4-byte columns.
template <class Acc, class Term>
void tile_dot(int c, int a, int b, Term term) {
  Tiles& t = tiles();
  const int m_rows = t.rows[c], n_cols = t.colsb[c] / 4, k_steps = t.colsb[a] / 4;
  for (int m = 0; m < m_rows; ++m)
    for (int n = 0; n < n_cols; ++n) {
      Acc acc;
      std::memcpy(&acc, t.data[c] + m * 64 + n * 4, 4);
      for (int k = 0; k < k_steps; ++k)
        acc += term(t.data[a] + m * 64 + k * 4, t.data[b] + k * 64 + n * 4);
      std::memcpy(t.data[c] + m * 64 + n * 4, &acc, 4);
    }
}

inline void dpbf16ps(int c, int a, int b) {
  tile_dot<float>(c, a, b, [](const uint8_t* x, const uint8_t* w) {
    return bf16(x) * bf16(w) + bf16(x + 2) * bf16(w + 2);
  });
}

inline void dpbusd(int c, int a, int b) {
  tile_dot<int32_t>(c, a, b, [](const uint8_t* x, const uint8_t* w) {
    int32_t sum = 0;
    for (int i = 0; i < 4; ++i) sum += int32_t(x[i]) * int32_t(int8_t(w[i]));
    return sum;
  });
}

}  // namespace hetmoe::amx_emulation

#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#undef _tile_dpbusd
#define _tile_loadconfig(config) ::hetmoe::amx_emulation::loadconfig(config)
#define _tile_release() ::hetmoe::amx_emulation::release()
#define _tile_zero(t) ::hetmoe::amx_emulation::zero(t)
#define _tile_loadd(t, base, stride) ::hetmoe::amx_emulation::loadd(t, base, long(stride))
#define _tile_stored(t, base, stride) ::hetmoe::amx_emulation::stored(t, base, long(stride))
#define _tile_dpbf16ps(c, a, b) ::hetmoe::amx_emulation::dpbf16ps(c, a, b)
#define _tile_dpbusd(c, a, b) ::hetmoe::amx_emulation::dpbusd(c, a, b)
