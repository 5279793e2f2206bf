// AMX fp8 kernel for many tokens per expert (prefill), after amx.cpp's bf16 path: per pair of
// n-blocks the e4m3 codes are widened once to bf16 B tiles (the fp8 block order widens to the
// bf16 block order element for element, exact: kernels/fp8_avx512.h), then every token-tile pair
// runs the 2 x 2 bf16 tile loop (amx_tiles.h) over one group of k at a time; each group's fp32 C
// tiles are stored into one of two buffers and scaled by the group's per-row scales into fp32
// accumulators on the vector units while the tile unit runs the next group.
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
  float* cb0 = reinterpret_cast<float*>(aligned_scratch(2 * 4 * 1024, 3));
  float* cb[2] = {cb0, cb0 + 1024};
  const __m512i subnormals = fp8_subnormal_table();
  const bool stream = a.stream_c && streamable(c, ldc);  // c's rows non-temporally (store_pair)
  for (int nb = nb_begin; nb < nb_end; nb += 2) {
    const bool two_n = nb + 1 < nb_end;
    widen_fp8(w, nb, wide, subnormals);
    if (two_n) widen_fp8(w, nb + 1, wide + wide_bytes, subnormals);
    Prefetch pf = next_pair(w, nb, nb_end, size_t(groups) * ((mp + 31) / 32) * steps);
    std::memset(acc, 0, size_t(mp) * 32 * sizeof(float));
    // Unit i (token pair, group) is stored into cb[i % 2]; the previous one is scaled meanwhile.
    struct Unit {
      int t = -1, nt = 0;
      const float* scale[2];
    } unit[2];
    auto scale_unit = [&](int i) {
      Unit& u = unit[i % 2];
      if (u.t >= 0) scale_into(cb[i % 2], u.nt, two_n ? 2 : 1, u.scale, acc + size_t(u.t) * 32);
      u.t = -1;
    };
    int i = 0;
    for (int t = 0; t < a.m; t += 32) {
      const bool two_t = t + 16 < a.m;
      for (int g = 0; g < groups; ++g, ++i) {
        const size_t koff = size_t(g) * steps * 1024;
        const uint8_t* at = x + size_t(t / 16) * tile_stride + koff;
        const uint8_t* b0 = wide + koff;
        const uint8_t* b1 = wide + wide_bytes + koff;
        float* out = cb[i % 2];
        if (two_t && two_n)
          bf16_tiles<2, 2>(at, tile_stride, b0, b1, steps, true, false, out, nullptr, 0, pf);
        else if (two_t)
          bf16_tiles<2, 1>(at, tile_stride, b0, b1, steps, true, false, out, nullptr, 0, pf);
        else if (two_n)
          bf16_tiles<1, 2>(at, tile_stride, b0, b1, steps, true, false, out, nullptr, 0, pf);
        else
          bf16_tiles<1, 1>(at, tile_stride, b0, b1, steps, true, false, out, nullptr, 0, pf);
        scale_unit(i + 1);  // the previous unit, while this one's tiles finish
        Unit& u = unit[i % 2];
        u.t = t;
        u.nt = two_t ? 2 : 1;
        u.scale[0] = w.scale + (size_t(nb) * groups + g) * kBlockN;
        u.scale[1] = w.scale + (size_t(two_n ? nb + 1 : nb) * groups + g) * kBlockN;
      }
    }
    scale_unit(i + 1);
    store_pair(acc, mp, two_n, c + (nb - nb_begin) * 16, ldc, stream);
  }
  sfence_if(stream);
  _tile_release();
}

}  // namespace hetmoe
