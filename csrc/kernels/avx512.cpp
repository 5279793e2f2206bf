// AVX-512 kernels, mostly for few tokens per expert (decode): BF16 dot products (vdpbf16ps) and
// VNNI u8 x s8 (vpdpbusd). A 64-byte block row is one register holding all 16 outputs, so each
// token needs only a broadcast of its matching activations and no horizontal sums. BF16 with
// many tokens (CPUs without AMX) runs register tiles of 6 tokens x 2 n-blocks (bf16_tile).
#include <immintrin.h>

#include "kernels/epilogue.h"
#include "kernels/gemm.h"

namespace hetmoe {
namespace {

constexpr int kMaxTokens = 4;

inline __m512i broadcast32(const void* p) {
  return _mm512_set1_epi32(*static_cast<const int32_t*>(p));
}

// BF16 and int4 read every line of their n-block range once, in order, and prefetch each line
// this far ahead (stopping at the range's end). With one prefetch per block (int8 still does
// that) one core streamed ~7 (int4) / ~10 (bf16) GB/s from DRAM; with every line ~10.6 / ~11.8,
// as int8 and a plain read; 15 cores: int4 76 -> 111 GB/s.
constexpr size_t kStreamAhead = 4096;

inline void prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

inline void prefetch_lines(const uint8_t* p, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 64) prefetch(p + i);
}

// `end`: the end of the n-blocks this call reads (prefetches stop there).
template <int MT>
void bf16_tokens(const uint8_t* blocks, int kblocks, const uint16_t* x, size_t ld, float* c,
                 size_t ldc, const uint8_t* end) {
  __m512 even[MT], odd[MT];
  for (int t = 0; t < MT; ++t) even[t] = odd[t] = _mm512_setzero_ps();
  for (int kb = 0; kb < kblocks; ++kb) {
    const uint8_t* blk = blocks + size_t(kb) * 1024;
    const bool ahead = blk + kStreamAhead + 1024 <= end;
    for (int r = 0; r < 16; r += 2) {
      if (ahead) {
        prefetch(blk + kStreamAhead + r * 64);
        prefetch(blk + kStreamAhead + r * 64 + 64);
      }
      const __m512bh w0 = (__m512bh)_mm512_load_si512(blk + r * 64);
      const __m512bh w1 = (__m512bh)_mm512_load_si512(blk + (r + 1) * 64);
      for (int t = 0; t < MT; ++t) {
        const uint16_t* xt = x + size_t(t) * ld + kb * 32 + r * 2;
        even[t] = _mm512_dpbf16_ps(even[t], (__m512bh)broadcast32(xt), w0);
        odd[t] = _mm512_dpbf16_ps(odd[t], (__m512bh)broadcast32(xt + 2), w1);
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    _mm512_storeu_ps(c + size_t(t) * ldc, _mm512_add_ps(even[t], odd[t]));
}

// Many tokens (prefill on a CPU without AMX, the bf16 backward's products): MT tokens x NB
// n-blocks of registers, so each weight row loaded serves MT tokens and each broadcast NB
// n-blocks (6 x 2: 24 accumulators, 4 weight rows and 12 broadcasts per 24 vdpbf16ps; the 4 x 1
// tiles above load 2 rows and 8 broadcasts per 8). The even and odd block rows keep separate
// sums as bf16_tokens does, so every output is the same float whichever kernel computed it.
template <int MT, int NB>
void bf16_tile(const uint8_t* b0, const uint8_t* b1, int kblocks, const uint16_t* x, size_t ld,
               float* c, size_t ldc) {
  __m512 even[MT][NB], odd[MT][NB];
  for (int t = 0; t < MT; ++t)
    for (int j = 0; j < NB; ++j) even[t][j] = odd[t][j] = _mm512_setzero_ps();
  const uint8_t* b[2] = {b0, b1};
  for (int kb = 0; kb < kblocks; ++kb)
    for (int r = 0; r < 16; r += 2) {
      __m512bh w0[NB], w1[NB];
      for (int j = 0; j < NB; ++j) {
        w0[j] = (__m512bh)_mm512_load_si512(b[j] + size_t(kb) * 1024 + r * 64);
        w1[j] = (__m512bh)_mm512_load_si512(b[j] + size_t(kb) * 1024 + (r + 1) * 64);
      }
      for (int t = 0; t < MT; ++t) {
        const uint16_t* xt = x + size_t(t) * ld + kb * 32 + r * 2;
        const __m512bh x0 = (__m512bh)broadcast32(xt), x1 = (__m512bh)broadcast32(xt + 2);
        for (int j = 0; j < NB; ++j) {
          even[t][j] = _mm512_dpbf16_ps(even[t][j], x0, w0[j]);
          odd[t][j] = _mm512_dpbf16_ps(odd[t][j], x1, w1[j]);
        }
      }
    }
  for (int t = 0; t < MT; ++t)
    for (int j = 0; j < NB; ++j)
      _mm512_storeu_ps(c + size_t(t) * ldc + 16 * j, _mm512_add_ps(even[t][j], odd[t][j]));
}

template <int NB>
void bf16_tiles(const uint8_t* b0, const uint8_t* b1, int kblocks, const ActView& a, float* c,
                size_t ldc) {
  constexpr int kTile = 6;
  for (int t = 0; t < a.m; t += kTile) {
    const uint16_t* x = a.bf16 + size_t(t) * a.ld;
    float* ct = c + size_t(t) * ldc;
    switch (a.m - t >= kTile ? kTile : a.m - t) {
      case 1: bf16_tile<1, NB>(b0, b1, kblocks, x, a.ld, ct, ldc); break;
      case 2: bf16_tile<2, NB>(b0, b1, kblocks, x, a.ld, ct, ldc); break;
      case 3: bf16_tile<3, NB>(b0, b1, kblocks, x, a.ld, ct, ldc); break;
      case 4: bf16_tile<4, NB>(b0, b1, kblocks, x, a.ld, ct, ldc); break;
      case 5: bf16_tile<5, NB>(b0, b1, kblocks, x, a.ld, ct, ldc); break;
      default: bf16_tile<6, NB>(b0, b1, kblocks, x, a.ld, ct, ldc); break;
    }
  }
}

// Tokens per expert from which gemm_bf16 runs the register tiles: below, decode's token groups
// stream each n-block once with their prefetch (on AMX hosts bf16 takes AMX from 2 tokens, so
// only CPUs without AMX reach the tiles).
constexpr int kTileMinTokens = 8;

void gemm_bf16(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
               size_t ldc) {
  const int kblocks = w.num_k_blocks();
  if (a.m >= kTileMinTokens) {
    for (int nb = nb_begin; nb < nb_end; nb += 2) {
      float* cn = c + (nb - nb_begin) * 16;
      if (nb + 1 < nb_end) bf16_tiles<2>(w.n_block(nb), w.n_block(nb + 1), kblocks, a, cn, ldc);
      else bf16_tiles<1>(w.n_block(nb), w.n_block(nb), kblocks, a, cn, ldc);
    }
    return;
  }
  const uint8_t* end = w.n_block(nb_end);
  for (int nb = nb_begin; nb < nb_end; ++nb) {
    float* cn = c + (nb - nb_begin) * 16;
    for (int t = 0; t < a.m; t += kMaxTokens) {
      const uint16_t* x = a.bf16 + size_t(t) * a.ld;
      float* ct = cn + size_t(t) * ldc;
      switch (a.m - t >= kMaxTokens ? kMaxTokens : a.m - t) {
        case 1: bf16_tokens<1>(w.n_block(nb), kblocks, x, a.ld, ct, ldc, end); break;
        case 2: bf16_tokens<2>(w.n_block(nb), kblocks, x, a.ld, ct, ldc, end); break;
        case 3: bf16_tokens<3>(w.n_block(nb), kblocks, x, a.ld, ct, ldc, end); break;
        default: bf16_tokens<4>(w.n_block(nb), kblocks, x, a.ld, ct, ldc, end); break;
      }
    }
  }
}

// 16 lanes of int4 metadata (bf16) as floats.
inline __m512 bf16x16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Adds one group's exact integer dot products to the float accumulators (gemm.h's formula).
template <bool kInt4, int MT>
inline void fix_up(const PackedMatrix& w, int nb, int g, const uint16_t* meta, const ActView& a,
                   int t0, __m512i* dot, __m512* acc) {
  const size_t at = (size_t(nb) * w.num_groups() + g) * kBlockN;
  const __m512 sw = kInt4 ? bf16x16(meta) : _mm512_loadu_ps(w.scale + at);
  const __m512 swq = kInt4 ? bf16x16(meta + 16) : _mm512_loadu_ps(w.scale_qsum + at);
  const __m512 bw = kInt4 ? bf16x16(meta + 32) : _mm512_setzero_ps();
  for (int t = 0; t < MT; ++t) {
    const size_t ga = size_t(t0 + t) * a.ldg + g;
    const __m512 f = _mm512_cvtepi32_ps(dot[t]);
    acc[t] = _mm512_fmadd_ps(f, _mm512_mul_ps(sw, _mm512_set1_ps(a.scale[ga])), acc[t]);
    acc[t] = _mm512_fmadd_ps(swq, _mm512_set1_ps(a.bias[ga]), acc[t]);
    if (kInt4) acc[t] = _mm512_fmadd_ps(bw, _mm512_set1_ps(a.sum[ga]), acc[t]);
    dot[t] = _mm512_setzero_si512();
  }
}

// `end`: the end of the n-blocks this call reads (int4 prefetches stop there).
template <bool kInt4, int MT>
void int_tokens(const PackedMatrix& w, int nb, const ActView& a, int t0, float* c, size_t ldc,
                const uint8_t* end) {
  const int kblocks = w.num_k_blocks(), gs = w.group_size;
  // Walk the blocks by pointer (no divisions in the loop): int4 runs of kpr blocks, each followed
  // by its groups' metadata, which a fix-up reads right after the run's last block.
  const int kpr = kInt4 ? w.run_k() / 64 : 1, kb_per_group = gs / 64;
  const size_t meta_bytes = kInt4 ? w.run_bytes() - size_t(kpr) * 512 : 0;
  const uint8_t* blk = w.n_block(nb);
  int in_run = 0, in_group = 0;
  const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  __m512i lo[MT], hi[MT];
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) {
    lo[t] = hi[t] = _mm512_setzero_si512();
    acc[t] = _mm512_setzero_ps();
  }
  for (int kb = 0; kb < kblocks; ++kb, blk += w.block_bytes()) {
    // Past the caller's n-blocks nothing is ours to fetch.
    const bool ahead = kInt4 && blk + kStreamAhead + w.run_bytes() <= end;
    if (!kInt4) prefetch(blk + 2048);  // int8: one line per block, 2 blocks ahead
    for (int r = 0; r < 8; ++r) {
      __m512i w0, w1;
      if (kInt4) {
        if (ahead) prefetch(blk + kStreamAhead + r * 64);
        const __m512i v = _mm512_load_si512(blk + r * 64);
        w0 = _mm512_sub_epi8(_mm512_and_si512(v, low4), eight);
        w1 = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), eight);
      } else {
        w0 = _mm512_load_si512(blk + r * 64);
        w1 = _mm512_load_si512(blk + (r + 8) * 64);
      }
      for (int t = 0; t < MT; ++t) {
        const uint8_t* xt = a.u8 + size_t(t0 + t) * a.ld + kb * 64;
        lo[t] = _mm512_dpbusd_epi32(lo[t], broadcast32(xt + r * 4), w0);
        hi[t] = _mm512_dpbusd_epi32(hi[t], broadcast32(xt + (r + 8) * 4), w1);
      }
    }
    const uint16_t* meta = reinterpret_cast<const uint16_t*>(blk + 512);
    if (gs == 32) {
      fix_up<kInt4, MT>(w, nb, 2 * kb, meta, a, t0, lo, acc);
      fix_up<kInt4, MT>(w, nb, 2 * kb + 1, meta + 48, a, t0, hi, acc);
    } else if (++in_group == kb_per_group) {
      in_group = 0;
      for (int t = 0; t < MT; ++t) {
        lo[t] = _mm512_add_epi32(lo[t], hi[t]);
        hi[t] = _mm512_setzero_si512();
      }
      fix_up<kInt4, MT>(w, nb, (kb + 1) / kb_per_group - 1, meta, a, t0, lo, acc);
    }
    if (kInt4 && ++in_run == kpr) {
      in_run = 0;
      if (ahead) prefetch_lines(blk + 512 + kStreamAhead, meta_bytes);
      blk += meta_bytes;
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(c + size_t(t) * ldc, acc[t]);
}

template <bool kInt4>
void gemm_int(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
              size_t ldc) {
  const uint8_t* end = w.n_block(nb_end);
  for (int nb = nb_begin; nb < nb_end; ++nb) {
    float* cn = c + (nb - nb_begin) * 16;
    for (int t = 0; t < a.m; t += kMaxTokens) {
      float* ct = cn + size_t(t) * ldc;
      switch (a.m - t >= kMaxTokens ? kMaxTokens : a.m - t) {
        case 1: int_tokens<kInt4, 1>(w, nb, a, t, ct, ldc, end); break;
        case 2: int_tokens<kInt4, 2>(w, nb, a, t, ct, ldc, end); break;
        case 3: int_tokens<kInt4, 3>(w, nb, a, t, ct, ldc, end); break;
        default: int_tokens<kInt4, 4>(w, nb, a, t, ct, ldc, end); break;
      }
    }
  }
}

}  // namespace

const IsaKernels& avx512_kernels() {
  static const IsaKernels k{"avx512", gemm_bf16, gemm_int<false>, gemm_int<true>,
                            avx512_gemm_fp8,
                            {silu_mul_row, to_bf16_row, to_u8_row, axpy_row}};
  return k;
}

}  // namespace hetmoe
