// A packed n-block read back as 16 fp32 rows (layout/packed_matrix.h), for the file that
// includes it (internal linkage: each ISA file compiles its own copy with its own flags; the
// loops run along contiguous block bytes so the compiler vectorizes the reads).
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

// bf16 block: element (n, k) at [k/2][n][k%2], 32 k per block.
inline void unpack_rows_bf16(const PackedMatrix& w, int nb, float* out, size_t ld) {
  for (int kb = 0; kb < w.num_k_blocks(); ++kb) {
    const uint16_t* blk = reinterpret_cast<const uint16_t*>(w.k_block(nb, kb));
    for (int r = 0; r < 16; ++r)
      for (int n = 0; n < kBlockN; ++n) {
        float* o = out + size_t(n) * ld + kb * 32 + 2 * r;
        o[0] = bf16_bits_to_float(blk[r * 32 + n * 2]);
        o[1] = bf16_bits_to_float(blk[r * 32 + n * 2 + 1]);
      }
  }
}

// Int blocks: 64 k, element (n, k) at [k/4][n][k%4]; int4 rows r and r + 8 share byte row r
// (low nibble r), value = nibble - 8. Per (group, n): int8 w = scale q; int4 w = scale q + bias.
inline void unpack_rows_int(const PackedMatrix& w, int nb, float* out, size_t ld) {
  const int gs = w.group_size, groups = w.num_groups();
  for (int kb = 0; kb < w.num_k_blocks(); ++kb) {
    const uint8_t* blk = w.k_block(nb, kb);
    for (int r = 0; r < 16; ++r) {
      const int k0 = kb * 64 + 4 * r, g = k0 / gs;
      const uint16_t* meta = w.int4() ? w.meta(nb, g) : nullptr;
      const size_t at = (size_t(nb) * groups + g) * kBlockN;
      for (int n = 0; n < kBlockN; ++n) {
        const float scale = w.int4() ? bf16_bits_to_float(meta[n]) : w.scale[at + n];
        const float bias = w.int4() ? bf16_bits_to_float(meta[32 + n]) : 0.0f;
        float* o = out + size_t(n) * ld + k0;
        for (int c = 0; c < 4; ++c) {
          int q;
          if (w.int4()) {
            const uint8_t byte = blk[(r % 8) * 64 + n * 4 + c];
            q = int((r < 8 ? byte : byte >> 4) & 0xF) - 8;
          } else {
            q = int8_t(blk[r * 64 + n * 4 + c]);
          }
          o[c] = w.int4() ? scale * float(q) + bias : scale * float(q);
        }
      }
    }
  }
}

// Fp8 n-block: codes [K/2][16][2]; per (group, n) w = scale * e4m3.
inline void unpack_rows_fp8(const PackedMatrix& w, int nb, float* out, size_t ld) {
  const uint8_t* codes = w.n_block(nb);
  const int gs = w.group_size, groups = w.num_groups();
  for (int k = 0; k < w.k; k += 2)
    for (int n = 0; n < kBlockN; ++n) {
      const float scale = w.scale[(size_t(nb) * groups + k / gs) * kBlockN + n];
      float* o = out + size_t(n) * ld + k;
      o[0] = scale * fp8_e4m3_to_float(codes[(k / 2) * 32 + n * 2]);
      o[1] = scale * fp8_e4m3_to_float(codes[(k / 2) * 32 + n * 2 + 1]);
    }
}

inline void unpack_rows(const PackedMatrix& w, int nb, float* out, size_t ld) {
  if (w.format == WeightFormat::kBF16)
    unpack_rows_bf16(w, nb, out, ld);
  else if (w.fp8())
    unpack_rows_fp8(w, nb, out, ld);
  else
    unpack_rows_int(w, nb, out, ld);
}

}  // namespace
}  // namespace hetmoe
