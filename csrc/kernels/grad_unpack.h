// Packed n-blocks (layout/packed_matrix.h) read back in fp32 one k at a time, for the grad kernel
// file that includes it (internal linkage: each ISA file compiles its own copy with its flags).
// The scalar and AVX2 backward use these; AVX-512 has its own vector forms of unpack_cols.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "layout/fp8.h"
#include "layout/packed_matrix.h"

namespace hetmoe {
namespace {

inline float bf16_bits_to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// out[n] = W[16 nb + n, k], n < 16. Block orders: bf16 [k/2][n][k%2] in 32-k blocks; int8
// [k/4][n][k%4] in 64-k blocks (int4: rows r and r + 8 share byte row r, low nibble r, value
// nibble - 8); fp8 codes [K/2][n][k%2] over the whole n-block. Per (group, n): int8 / fp8
// w = scale * q, int4 w = scale * q + bias.
inline void weight_column(const PackedMatrix& w, int nb, int k, float* out) {
  if (w.format == WeightFormat::kBF16) {
    const uint16_t* row =
        reinterpret_cast<const uint16_t*>(w.k_block(nb, k / 32)) + (k % 32) / 2 * 32 + k % 2;
    for (int n = 0; n < kBlockN; ++n) out[n] = bf16_bits_to_float(row[2 * n]);
    return;
  }
  const int g = k / w.group_size;
  const float* scale = w.scale + (size_t(nb) * w.num_groups() + g) * kBlockN;
  if (w.fp8()) {
    const uint8_t* row = w.n_block(nb) + size_t(k / 2) * 32 + k % 2;
    for (int n = 0; n < kBlockN; ++n) out[n] = scale[n] * fp8_e4m3_to_float(row[2 * n]);
    return;
  }
  const int r = (k % 64) / 4;
  const uint8_t* blk = w.k_block(nb, k / 64);
  if (w.int4()) {
    const uint16_t* meta = w.meta(nb, g);
    const uint8_t* row = blk + (r % 8) * 64 + k % 4;
    for (int n = 0; n < kBlockN; ++n) {
      const int q = int((r < 8 ? row[4 * n] : row[4 * n] >> 4) & 0xF) - 8;
      out[n] = bf16_bits_to_float(meta[n]) * float(q) + bf16_bits_to_float(meta[32 + n]);
    }
    return;
  }
  const uint8_t* row = blk + r * 64 + k % 4;
  for (int n = 0; n < kBlockN; ++n) out[n] = scale[n] * float(int8_t(row[4 * n]));
}

inline void unpack_cols_scalar(const PackedMatrix& w, int nb, int k0, int k1, float* out,
                               size_t ld) {
  for (int k = k0; k < k1; ++k) weight_column(w, nb, k, out + size_t(k - k0) * ld);
}

inline void unpack_rows_scalar(const PackedMatrix& w, int nb, int k0, int k1, float* out,
                               size_t ld) {
  float col[kBlockN];
  for (int k = k0; k < k1; ++k) {
    weight_column(w, nb, k, col);
    for (int n = 0; n < kBlockN; ++n) out[size_t(n) * ld + (k - k0)] = col[n];
  }
}

}  // namespace
}  // namespace hetmoe
