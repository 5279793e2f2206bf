// AMX kernels for many tokens per expert (prefill): BF16 tdpbf16ps and u8 x s8 tdpbusd over
// 2 x 2 output tiles (32 tokens x 32 outputs). The packed blocks are B tiles as they lie; int4
// n-blocks are widened to int8 once per call. Int groups are fixed up in fp32 per group.
// Activations are copied once per call into tile order (each A tile 1 KB contiguous): row-major
// rows 4 KB apart all map to one L1 set, and 16-row tile loads from them thrash it (single-core
// 2x2-tile loop 0.38 -> 0.48 TFLOPS in a microbenchmark).
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "kernels/epilogue.h"
#include "kernels/gemm.h"

namespace hetmoe {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: C (token tile i, n-block j) at 2 * i + j; tmm4-5: A; tmm6-7: B. k_bytes per step.
void configure(int k_bytes) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  cfg.colsb[4] = cfg.colsb[5] = uint16_t(k_bytes);
  cfg.rows[6] = cfg.rows[7] = uint8_t(k_bytes / 4);
  _tile_loadconfig(&cfg);
}

// 64-byte aligned per-thread scratch; `slot` keeps separate buffers apart.
uint8_t* aligned_scratch(size_t bytes, int slot) {
  thread_local std::vector<uint8_t> buf[2];
  if (buf[slot].size() < bytes + 64) buf[slot].resize(bytes + 64);
  const uintptr_t base = reinterpret_cast<uintptr_t>(buf[slot].data());
  return reinterpret_cast<uint8_t*>((base + 63) & ~uintptr_t(63));
}

// Rows [0, round_up(m, 16)) of row-major A (`row_bytes` used per row, `ld_bytes` apart) in tile
// order: [m / 16][row_bytes / step][16 rows][step bytes], so A tile (t, s) is 16 * step bytes.
const uint8_t* tile_order(const uint8_t* a, size_t ld_bytes, int m, size_t row_bytes,
                          int step) {
  const int mp = int(round_up(m, 16)), steps = int(row_bytes / step);
  uint8_t* out = aligned_scratch(size_t(mp) * row_bytes, 1);
  for (int tb = 0; tb < mp / 16; ++tb)
    for (int r = 0; r < 16; ++r) {
      const uint8_t* src = a + (size_t(tb) * 16 + r) * ld_bytes;
      uint8_t* dst = out + size_t(tb) * steps * 16 * step + size_t(r) * step;
      for (int s = 0; s < steps; ++s)
        std::memcpy(dst + size_t(s) * 16 * step, src + s * step, step);
    }
  return out;
}

// x: A in tile order (32 k per 1 KB tile).
template <int NT, int NN>
void bf16_tiles(const PackedMatrix& w, const uint8_t* x, int t0, int nb, float* c, size_t ldc) {
  _tile_zero(0);
  if (NN > 1) _tile_zero(1);
  if (NT > 1) _tile_zero(2);
  if (NT > 1 && NN > 1) _tile_zero(3);
  const int kbs = w.num_k_blocks();
  const uint8_t* a0 = x + size_t(t0 / 16) * kbs * 1024;
  const uint8_t* b0 = w.n_block(nb);
  const uint8_t* b1 = NN > 1 ? w.n_block(nb + 1) : b0;
  for (int kb = 0; kb < kbs; ++kb) {
    _tile_loadd(4, a0 + kb * 1024, 64);
    _tile_loadd(6, b0 + kb * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NN > 1) {
      _tile_loadd(7, b1 + kb * 1024, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (NT > 1) {
      _tile_loadd(5, a0 + size_t(kbs + kb) * 1024, 64);
      _tile_dpbf16ps(2, 5, 6);
      if (NN > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const size_t ldcb = ldc * 4;
  _tile_stored(0, c, ldcb);
  if (NN > 1) _tile_stored(1, c + 16, ldcb);
  if (NT > 1) _tile_stored(2, c + 16 * ldc, ldcb);
  if (NT > 1 && NN > 1) _tile_stored(3, c + 16 * ldc + 16, ldcb);
}

void gemm_bf16(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
               size_t ldc) {
  configure(64);
  const uint8_t* x = tile_order(reinterpret_cast<const uint8_t*>(a.bf16), a.ld * 2, a.m,
                                size_t(w.k) * 2, 64);
  for (int nb = nb_begin; nb < nb_end; nb += 2) {
    const bool two_n = nb + 1 < nb_end;
    for (int t = 0; t < a.m; t += 32) {
      float* ct = c + size_t(t) * ldc + (nb - nb_begin) * 16;
      const bool two_t = t + 16 < a.m;
      if (two_t && two_n) bf16_tiles<2, 2>(w, x, t, nb, ct, ldc);
      else if (two_t) bf16_tiles<2, 1>(w, x, t, nb, ct, ldc);
      else if (two_n) bf16_tiles<1, 2>(w, x, t, nb, ct, ldc);
      else bf16_tiles<1, 1>(w, x, t, nb, ct, ldc);
    }
  }
  _tile_release();
}

// Widens an int4 n-block to the int8 block layout (same rows, 1024 bytes per 64-k block).
void widen_int4(const PackedMatrix& w, int nb, uint8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  for (int kb = 0; kb < w.num_k_blocks(); ++kb)
    for (int r = 0; r < 8; ++r) {
      const __m512i v = _mm512_load_si512(w.k_block(nb, kb) + r * 64);
      _mm512_store_si512(out + kb * 1024 + r * 64,
                         _mm512_sub_epi8(_mm512_and_si512(v, low4), eight));
      _mm512_store_si512(out + kb * 1024 + (r + 8) * 64,
                         _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), eight));
    }
}

// 16 lanes of int4 metadata (bf16) as floats.
inline __m512 bf16x16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// acc[row][32] += fix-up of the int32 tile `dot` (16 x 16) for group g, outputs of n-block nb.
template <bool kInt4>
void fix_up(const PackedMatrix& w, int nb, int g, const ActView& a, int t0, const int32_t* dot,
            float* acc) {
  const size_t at = (size_t(nb) * w.num_groups() + g) * kBlockN;
  const uint16_t* meta = kInt4 ? w.meta(nb, g) : nullptr;
  const __m512 sw = kInt4 ? bf16x16(meta) : _mm512_loadu_ps(w.scale + at);
  const __m512 swq = kInt4 ? bf16x16(meta + 16) : _mm512_loadu_ps(w.scale_qsum + at);
  const __m512 bw = kInt4 ? bf16x16(meta + 32) : _mm512_setzero_ps();
  for (int r = 0; r < 16; ++r) {
    const size_t ga = size_t(t0 + r) * a.ldg + g;
    __m512 v = _mm512_loadu_ps(acc + r * 32);
    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dot + r * 16)),
                        _mm512_mul_ps(sw, _mm512_set1_ps(a.scale[ga])), v);
    v = _mm512_fmadd_ps(swq, _mm512_set1_ps(a.bias[ga]), v);
    if (kInt4) v = _mm512_fmadd_ps(bw, _mm512_set1_ps(a.sum[ga]), v);
    _mm512_storeu_ps(acc + r * 32, v);
  }
}

// b0/b1: int8 n-blocks (packed or widened). k_bytes = min(64, group size); x: A in tile order.
template <bool kInt4, int NT, int NN>
void int_tiles(const PackedMatrix& w, const ActView& a, const uint8_t* x, int t0, int nb,
               const uint8_t* b0, const uint8_t* b1, int k_bytes, float* c, size_t ldc) {
  alignas(64) int32_t dot[4][256];
  alignas(64) float acc[2][16 * 32] = {};
  const int steps_per_group = w.group_size / k_bytes;
  const size_t tile_bytes = size_t(16) * k_bytes, block_bytes = size_t(16) * w.k;
  const uint8_t* x0 = x + size_t(t0 / 16) * block_bytes;
  for (int g = 0; g < w.num_groups(); ++g) {
    _tile_zero(0);
    if (NN > 1) _tile_zero(1);
    if (NT > 1) _tile_zero(2);
    if (NT > 1 && NN > 1) _tile_zero(3);
    for (int s = 0; s < steps_per_group; ++s) {
      const int k = g * w.group_size + s * k_bytes;
      // Offset of this k in the int8 block layout: block k/64, row (k%64)/4.
      const size_t boff = size_t(k / 64) * 1024 + (k % 64) / 4 * 64;
      _tile_loadd(4, x0 + size_t(k / k_bytes) * tile_bytes, k_bytes);
      _tile_loadd(6, b0 + boff, 64);
      _tile_dpbusd(0, 4, 6);
      if (NN > 1) {
        _tile_loadd(7, b1 + boff, 64);
        _tile_dpbusd(1, 4, 7);
      }
      if (NT > 1) {
        _tile_loadd(5, x0 + block_bytes + size_t(k / k_bytes) * tile_bytes, k_bytes);
        _tile_dpbusd(2, 5, 6);
        if (NN > 1) _tile_dpbusd(3, 5, 7);
      }
    }
    _tile_stored(0, dot[0], 64);
    fix_up<kInt4>(w, nb, g, a, t0, dot[0], acc[0]);
    if (NN > 1) {
      _tile_stored(1, dot[1], 64);
      fix_up<kInt4>(w, nb + 1, g, a, t0, dot[1], acc[0] + 16);
    }
    if (NT > 1) {
      _tile_stored(2, dot[2], 64);
      fix_up<kInt4>(w, nb, g, a, t0 + 16, dot[2], acc[1]);
      if (NN > 1) {
        _tile_stored(3, dot[3], 64);
        fix_up<kInt4>(w, nb + 1, g, a, t0 + 16, dot[3], acc[1] + 16);
      }
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < 16; ++r)
      std::memcpy(c + (size_t(i) * 16 + r) * ldc, acc[i] + r * 32, sizeof(float) * 16 * NN);
}

template <bool kInt4>
void gemm_int(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
              size_t ldc) {
  const int k_bytes = w.group_size < 64 ? w.group_size : 64;
  const size_t nbytes = size_t(w.num_k_blocks()) * 1024;
  uint8_t* wide = kInt4 ? aligned_scratch(2 * nbytes, 0) : nullptr;
  configure(k_bytes);
  const uint8_t* x = tile_order(a.u8, a.ld, a.m, size_t(w.k), k_bytes);
  for (int nb = nb_begin; nb < nb_end; nb += 2) {
    const bool two_n = nb + 1 < nb_end;
    const uint8_t* b0 = w.n_block(nb);
    const uint8_t* b1 = two_n ? w.n_block(nb + 1) : b0;
    if (kInt4) {
      widen_int4(w, nb, wide);
      if (two_n) widen_int4(w, nb + 1, wide + nbytes);
      b0 = wide;
      b1 = wide + nbytes;
    }
    for (int t = 0; t < a.m; t += 32) {
      float* ct = c + size_t(t) * ldc + (nb - nb_begin) * 16;
      const bool two_t = t + 16 < a.m;
      if (two_t && two_n) int_tiles<kInt4, 2, 2>(w, a, x, t, nb, b0, b1, k_bytes, ct, ldc);
      else if (two_t) int_tiles<kInt4, 2, 1>(w, a, x, t, nb, b0, b1, k_bytes, ct, ldc);
      else if (two_n) int_tiles<kInt4, 1, 2>(w, a, x, t, nb, b0, b1, k_bytes, ct, ldc);
      else int_tiles<kInt4, 1, 1>(w, a, x, t, nb, b0, b1, k_bytes, ct, ldc);
    }
  }
  _tile_release();
}

}  // namespace

const IsaKernels& amx_kernels() {
  static const IsaKernels k{"amx", gemm_bf16, gemm_int<false>, gemm_int<true>,
                            {silu_mul_row, to_bf16_row, to_u8_row, axpy_row}};
  return k;
}

}  // namespace hetmoe
