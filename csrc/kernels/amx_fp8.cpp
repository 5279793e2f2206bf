// AMX fp8 kernel for many tokens per expert (prefill), after amx.cpp's bf16 path: per pair of
// n-blocks the e4m3 codes are widened once to bf16 B tiles (the fp8 block order widens to the
// bf16 block order element for element, exact: kernels/fp8_avx512.h), then every token-tile pair
// runs tdpbf16ps over one group of k at a time; each group's fp32 C tiles are stored and scaled
// by the group's per-row scales into fp32 accumulators on the vector units.
// Not run on a machine without AMX: tests/experts/test_fp8_experts.py covers it where AMX is.
#include <immintrin.h>

#include <cstring>

#include "kernels/amx_tiles.h"
#include "kernels/fp8_avx512.h"
#include "kernels/gemm.h"

namespace hetmoe {
namespace {

// n-block nb's codes ([K/2][16][2] bytes) -> bf16 n-block ([K/2][16][2] words, 32-k B tiles).
void widen_fp8(const PackedMatrix& w, int nb, uint8_t* out, __m512i subnormals) {
  const uint8_t* codes = w.n_block(nb);
  const size_t bytes = w.n_block_bytes();
  for (size_t i = 0; i < bytes; i += 32)
    _mm512_store_si512(out + 2 * i, fp8x32_to_bf16(codes + i, subnormals));
}

// C tiles of token tiles (t, t + 1) x n-blocks (nb, nb + 1) over one group's `steps` k-steps,
// from zero, stored to cb (tile 2 * i + j at cb + 256 * (2 * i + j) floats, rows 64 bytes).
// a: the first token tile's A at the group's k, a_next bytes to the second's; b0/b1 likewise.
template <int NT, int NN>
void group_tiles(const uint8_t* a, size_t a_next, const uint8_t* b0, const uint8_t* b1,
                 int steps, float* cb) {
  _tile_zero(0);
  if (NN > 1) _tile_zero(1);
  if (NT > 1) _tile_zero(2);
  if (NT > 1 && NN > 1) _tile_zero(3);
  for (int s = 0; s < steps; ++s) {
    const size_t off = size_t(s) * 1024;
    _tile_loadd(4, a + off, 64);
    _tile_loadd(6, b0 + off, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NN > 1) {
      _tile_loadd(7, b1 + off, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (NT > 1) {
      _tile_loadd(5, a + a_next + off, 64);
      _tile_dpbf16ps(2, 5, 6);
      if (NN > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cb, 64);
  if (NN > 1) _tile_stored(1, cb + 256, 64);
  if (NT > 1) _tile_stored(2, cb + 512, 64);
  if (NT > 1 && NN > 1) _tile_stored(3, cb + 768, 64);
}

// acc rows t.. (32 floats each: the pair's two n-blocks) += the stored C tiles x the scales.
void scale_into(const float* cb, int nt, int nn, const float* const scale[2], float* acc) {
  for (int i = 0; i < nt; ++i)
    for (int j = 0; j < nn; ++j) {
      const __m512 s = _mm512_loadu_ps(scale[j]);
      const float* tile = cb + 256 * (2 * i + j);
      for (int r = 0; r < 16; ++r) {
        float* row = acc + size_t(16 * i + r) * 32 + 16 * j;
        _mm512_storeu_ps(row, _mm512_fmadd_ps(_mm512_load_ps(tile + 16 * r), s,
                                              _mm512_loadu_ps(row)));
      }
    }
}

}  // namespace

void amx_gemm_fp8(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
                  size_t ldc) {
  configure(64);
  const uint8_t* x = tile_order(reinterpret_cast<const uint8_t*>(a.bf16), a.ld * 2, a.m,
                                size_t(w.k) * 2, 64, a.tile_step);
  const int groups = w.num_groups(), steps = w.group_size / 32, mp = int(round_up(a.m, 16));
  const size_t tile_stride = a.tile_step ? 16 * a.ld * 2 : size_t(w.k / 32) * 1024;
  const size_t wide_bytes = 2 * w.n_block_bytes();  // one n-block in bf16
  uint8_t* wide = aligned_scratch(2 * wide_bytes, 0);
  float* acc = reinterpret_cast<float*>(aligned_scratch(size_t(mp) * 32 * sizeof(float), 2));
  float* cb = reinterpret_cast<float*>(aligned_scratch(4 * 1024, 3));
  const __m512i subnormals = fp8_subnormal_table();
  for (int nb = nb_begin; nb < nb_end; nb += 2) {
    const bool two_n = nb + 1 < nb_end;
    widen_fp8(w, nb, wide, subnormals);
    if (two_n) widen_fp8(w, nb + 1, wide + wide_bytes, subnormals);
    Prefetch pf = next_pair(w, nb, nb_end, size_t(groups) * ((mp + 31) / 32));
    std::memset(acc, 0, size_t(mp) * 32 * sizeof(float));
    for (int t = 0; t < a.m; t += 32) {
      const bool two_t = t + 16 < a.m;
      for (int g = 0; g < groups; ++g) {
        pf.step();
        const size_t koff = size_t(g) * steps * 1024;
        const uint8_t* at = x + size_t(t / 16) * tile_stride + koff;
        const uint8_t* b0 = wide + koff;
        const uint8_t* b1 = wide + wide_bytes + koff;
        if (two_t && two_n) group_tiles<2, 2>(at, tile_stride, b0, b1, steps, cb);
        else if (two_t) group_tiles<2, 1>(at, tile_stride, b0, b1, steps, cb);
        else if (two_n) group_tiles<1, 2>(at, tile_stride, b0, b1, steps, cb);
        else group_tiles<1, 1>(at, tile_stride, b0, b1, steps, cb);
        const float* scale[2] = {w.scale + (size_t(nb) * groups + g) * kBlockN,
                                 w.scale + (size_t(two_n ? nb + 1 : nb) * groups + g) * kBlockN};
        scale_into(cb, two_t ? 2 : 1, two_n ? 2 : 1, scale, acc + size_t(t) * 32);
      }
    }
    for (int r = 0; r < mp; ++r)
      std::memcpy(c + size_t(r) * ldc + (nb - nb_begin) * 16, acc + size_t(r) * 32,
                  sizeof(float) * 16 * (two_n ? 2 : 1));
  }
  _tile_release();
}

}  // namespace hetmoe
