// AMX kernels for many tokens per expert (prefill): BF16 tdpbf16ps and u8 x s8 tdpbusd, one pair
// of n-blocks (32 outputs) at a time over all of the call's token tiles, so each B tile is read
// from DRAM once and then reused from L1, in 2 x 2 output tiles (two token tiles x the pair; bf16:
// K chunks; int8: per group). The next pair's weights are prefetched into L2 meanwhile. The packed
// blocks are B tiles as they lie. Int8 groups are fixed up in fp32 per group, on the vector units
// while the tile unit works; int4 (groups of 32: four times the fix-ups) is widened to bf16
// instead and runs the bf16 loop (amx_int4.cpp).
// Activations are read in tile order (each A tile 1 KB contiguous): row-major rows 4 KB apart all
// map to one L1 set, and 16-row tile loads from them thrash it (single-core 2x2-tile loop 0.38 ->
// 0.48 TFLOPS in a microbenchmark). Prefill writes them so (ActView::tile_step) and they are read
// in place; row-major views are copied into tile order once per call.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "dispatch.h"
#include "kernels/amx_tiles.h"
#include "kernels/epilogue.h"
#include "kernels/gemm.h"

namespace hetmoe {
namespace {

void gemm_bf16(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
               size_t ldc) {
  configure(64);
  const uint8_t* x = tile_order(reinterpret_cast<const uint8_t*>(a.bf16), a.ld * 2, a.m,
                                size_t(w.k) * 2, 64, a.tile_step);
  const int kbs = w.num_k_blocks(), pairs = (a.m + 31) / 32;
  // Bytes between token tiles: 16 rows of the view in place, of the copy's K otherwise.
  const size_t tile_stride = a.tile_step ? 16 * a.ld * 2 : size_t(kbs) * 1024;
  float* cbuf = reinterpret_cast<float*>(aligned_scratch(size_t(pairs) * 4096, 0));
  const bool stream = a.stream_c && streamable(c, ldc);
  for (int nb = nb_begin; nb < nb_end; nb += 2) {
    const bool two_n = nb + 1 < nb_end;
    const uint8_t* b0 = w.n_block(nb);
    Prefetch pf = next_pair(w, nb, nb_end, size_t(kbs) * pairs);
    bf16_pair(x, tile_stride, a.m, b0, two_n ? w.n_block(nb + 1) : b0, two_n, kbs, pf, cbuf,
              c + (nb - nb_begin) * 16, ldc, stream);
  }
  sfence_if(stream);
  _tile_release();
}

// Int32 tiles of one token tile and group waiting for their fix-up (the pair's two n-blocks).
struct PendingDots {
  alignas(64) int32_t dot[2][256];
  int t = -1, g = 0;
};

// Int8 group metadata of n-block nb, group g, as 16 fp32 lanes: weight scale and its zero-point
// term.
struct GroupMeta {
  __m512 sw, swq;
  GroupMeta(const PackedMatrix& w, int nb, int g, int num_groups) {
    const size_t at = (size_t(nb) * num_groups + g) * kBlockN;
    sw = _mm512_loadu_ps(w.scale + at);
    swq = _mm512_loadu_ps(w.scale_qsum + at);
  }
  // v + dot * (sw * sx) + swq * bx: the order every ISA uses, so floats agree.
  __m512 apply(__m512 v, const int32_t* dot, __m512 sx, __m512 bx) const {
    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dot)), _mm512_mul_ps(sw, sx), v);
    return _mm512_fmadd_ps(swq, bx, v);
  }
};

// The activations' per-(row, group) terms, group-major ([group][mp] each): a fix-up then reads one
// cache line per array for its 16 rows instead of 16 lines (row-major rows are a group count of
// floats apart), which kept them out of L1.
struct GroupTerms {
  const float* scale;
  const float* bias;
  size_t mp;
};

GroupTerms group_major(const ActView& a, int groups, int mp) {
  float* out = reinterpret_cast<float*>(aligned_scratch(size_t(2) * groups * mp * 4, 3));
  const float* src[2] = {a.scale, a.bias};
  for (int i = 0; i < 2; ++i)
    for (int r = 0; r < mp; ++r)
      for (int g = 0; g < groups; ++g)
        out[(size_t(i) * groups + g) * mp + r] = src[i][size_t(r) * a.ldg + g];
  return {out, out + size_t(groups) * mp, size_t(mp)};
}

// acc rows p.t .. p.t + 15 (32 floats each: the pair's two n-blocks) += the fix-up of `p`, which
// is then marked done. Each row's activation terms are broadcast once for both n-blocks.
void fix_up(const PackedMatrix& w, const GroupTerms& x, int nb, bool two_n, PendingDots& p,
            float* acc) {
  if (p.t < 0) return;
  const int groups = w.num_groups();
  const GroupMeta m0(w, nb, p.g, groups), m1(w, two_n ? nb + 1 : nb, p.g, groups);
  const size_t at0 = size_t(p.g) * x.mp + p.t;
  const float* __restrict sx = x.scale + at0;
  const float* __restrict bx = x.bias + at0;
  float* __restrict at = acc + size_t(p.t) * 32;
  for (int r = 0; r < 16; ++r) {
    const __m512 s = _mm512_set1_ps(sx[r]), b = _mm512_set1_ps(bx[r]);
    float* row = at + size_t(r) * 32;
    _mm512_storeu_ps(row, m0.apply(_mm512_loadu_ps(row), p.dot[0] + r * 16, s, b));
    if (two_n)
      _mm512_storeu_ps(row + 16, m1.apply(_mm512_loadu_ps(row + 16), p.dot[1] + r * 16, s, b));
  }
  p.t = -1;
}

// One n-block pair over all groups, two token tiles at a time: per k-step two A tiles and the
// pair's two B tiles feed four tdpbusd into four C tiles (2 x 2: one tile load per tdpbusd, four
// independent accumulation chains). Every group's int32 tiles must leave the tile unit for their
// fp32 fix-up: a unit's tiles are stored into one of two buffers, and the vector units fix up the
// previous unit's buffer while the tile unit runs the next one's tdpbusd. Fix-ups stay in group
// order per token tile: the floats do not change. B is loaded once per group and kept in its tile
// registers when the group is one k-step, else reloaded per token pair (from L1).
// b0/b1: the int8 n-blocks; x: A in tile order, token tiles block_bytes apart; k_bytes = min(64,
// group size).
void int_pair(const PackedMatrix& w, int m, const GroupTerms& terms, const uint8_t* x,
              size_t block_bytes, int nb, bool two_n, const uint8_t* b0, const uint8_t* b1,
              int k_bytes, float* acc, Prefetch& pf) {
  PendingDots pend[2][2];  // [buffer][token tile of the unit]
  const int steps = w.group_size / k_bytes;
  const bool b_resident = steps == 1;
  auto fix = [&](PendingDots* p) {
    fix_up(w, terms, nb, two_n, p[0], acc);
    fix_up(w, terms, nb, two_n, p[1], acc);
  };
  int i = 0;  // units (token pair, group) issued so far; unit i is stored into pend[i % 2]
  for (int g = 0; g < w.num_groups(); ++g) {
    const int kg = g * w.group_size;
    if (b_resident) {
      const size_t boff = size_t(kg / 64) * 1024 + (kg % 64) / 4 * 64;
      _tile_loadd(6, b0 + boff, 64);
      if (two_n) _tile_loadd(7, b1 + boff, 64);
    }
    for (int t = 0; t < m; t += 32, ++i) {
      const uint8_t* x0 = x + size_t(t / 16) * block_bytes;
      const bool two_t = t + 16 < m;
      pf.step();
      _tile_zero(0);
      if (two_n) _tile_zero(1);
      if (two_t) _tile_zero(2);
      if (two_t && two_n) _tile_zero(3);
      for (int s = 0; s < steps; ++s) {
        const int k = kg + s * k_bytes;
        // k in the int8 block layout: block k / 64, row (k % 64) / 4
        const size_t boff = size_t(k / 64) * 1024 + (k % 64) / 4 * 64;
        const size_t aoff = size_t(k / k_bytes) * 16 * k_bytes;
        _tile_loadd(4, x0 + aoff, k_bytes);
        if (!b_resident) {
          _tile_loadd(6, b0 + boff, 64);
          if (two_n) _tile_loadd(7, b1 + boff, 64);
        }
        _tile_dpbusd(0, 4, 6);
        if (two_n) _tile_dpbusd(1, 4, 7);
        if (two_t) {
          _tile_loadd(5, x0 + block_bytes + aoff, k_bytes);
          _tile_dpbusd(2, 5, 6);
          if (two_n) _tile_dpbusd(3, 5, 7);
        }
      }
      // While those run: fix up the previous unit, then store this one.
      fix(pend[(i + 1) % 2]);
      PendingDots* p = pend[i % 2];
      _tile_stored(0, p[0].dot[0], 64);
      if (two_n) _tile_stored(1, p[0].dot[1], 64);
      p[0].t = t;
      p[0].g = g;
      if (two_t) {
        _tile_stored(2, p[1].dot[0], 64);
        if (two_n) _tile_stored(3, p[1].dot[1], 64);
        p[1].t = t + 16;
        p[1].g = g;
      }
    }
  }
  fix(pend[(i + 1) % 2]);
  fix(pend[i % 2]);
}

void gemm_int8(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
               size_t ldc) {
  const int k_bytes = w.group_size < 64 ? w.group_size : 64;
  const int mp = int(round_up(a.m, 16));
  float* acc = reinterpret_cast<float*>(aligned_scratch(size_t(mp) * 32 * sizeof(float), 2));
  configure(k_bytes);
  const uint8_t* x = tile_order(a.u8, a.ld, a.m, size_t(w.k), k_bytes, a.tile_step);
  const size_t block_bytes = 16 * (a.tile_step ? a.ld : size_t(w.k));
  const GroupTerms terms = group_major(a, w.num_groups(), mp);
  const bool stream = a.stream_c && streamable(c, ldc);  // c's rows non-temporally (store_pair)
  for (int nb = nb_begin; nb < nb_end; nb += 2) {
    const bool two_n = nb + 1 < nb_end;
    const uint8_t* b0 = w.n_block(nb);
    const uint8_t* b1 = two_n ? w.n_block(nb + 1) : b0;
    Prefetch pf = next_pair(w, nb, nb_end, size_t(w.num_groups()) * (mp / 16));
    std::memset(acc, 0, size_t(mp) * 32 * sizeof(float));
    int_pair(w, a.m, terms, x, block_bytes, nb, two_n, b0, b1, k_bytes, acc, pf);
    store_pair(acc, mp, two_n, c + (nb - nb_begin) * 16, ldc, stream);
  }
  sfence_if(stream);
  _tile_release();
}

}  // namespace

const IsaKernels& amx_kernels() {
  // The int4 entry from HETMOE_AMX_INT4, parsed in dispatch.cpp: bf16 tiles unless "i8" opts in.
  static const IsaKernels k{"amx", gemm_bf16, gemm_int8,
                            std::strcmp(amx_int4_kernel(), "i8") == 0 ? amx_gemm_int4_i8
                                                                      : amx_gemm_int4,
                            amx_gemm_fp8,
                            {silu_mul_row, to_bf16_row, to_u8_row, axpy_row}};
  return k;
}

}  // namespace hetmoe
