// AVX2 + FMA kernels: the fallback for CPUs without AVX-512. BF16 weights are widened to fp32
// by shifts; int weights and u8 activations are widened to 16 bits for exact vpmaddwd products.
#include <immintrin.h>

#include "kernels/epilogue.h"
#include "kernels/gemm.h"

namespace hetmoe {
namespace {

constexpr int kMaxTokens = 4;

inline __m256 bf16_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 bf16_odd(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline float bf16_value(uint16_t v) {
  return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(int(v) << 16)));
}

template <int MT>
void bf16_tokens(const uint8_t* blocks, int kblocks, const uint16_t* x, size_t ld, float* c,
                 size_t ldc) {
  __m256 acc0[MT], acc1[MT];
  for (int t = 0; t < MT; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
  for (int kb = 0; kb < kblocks; ++kb) {
    const uint8_t* blk = blocks + size_t(kb) * 1024;
    for (int r = 0; r < 16; ++r) {
      const __m256i v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + r * 64));
      const __m256i v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + r * 64 + 32));
      const __m256 e0 = bf16_even(v0), o0 = bf16_odd(v0), e1 = bf16_even(v1), o1 = bf16_odd(v1);
      for (int t = 0; t < MT; ++t) {
        const uint16_t* xt = x + size_t(t) * ld + kb * 32 + r * 2;
        const __m256 xe = _mm256_set1_ps(bf16_value(xt[0])), xo = _mm256_set1_ps(bf16_value(xt[1]));
        acc0[t] = _mm256_fmadd_ps(o0, xo, _mm256_fmadd_ps(e0, xe, acc0[t]));
        acc1[t] = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(e1, xe, acc1[t]));
      }
    }
  }
  for (int t = 0; t < MT; ++t) {
    _mm256_storeu_ps(c + size_t(t) * ldc, acc0[t]);
    _mm256_storeu_ps(c + size_t(t) * ldc + 8, acc1[t]);
  }
}

void gemm_bf16(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
               size_t ldc) {
  const int kblocks = w.num_k_blocks();
  for (int nb = nb_begin; nb < nb_end; ++nb) {
    float* cn = c + (nb - nb_begin) * 16;
    for (int t = 0; t < a.m; t += kMaxTokens) {
      const uint16_t* x = a.bf16 + size_t(t) * a.ld;
      float* ct = cn + size_t(t) * ldc;
      switch (a.m - t >= kMaxTokens ? kMaxTokens : a.m - t) {
        case 1: bf16_tokens<1>(w.n_block(nb), kblocks, x, a.ld, ct, ldc); break;
        case 2: bf16_tokens<2>(w.n_block(nb), kblocks, x, a.ld, ct, ldc); break;
        case 3: bf16_tokens<3>(w.n_block(nb), kblocks, x, a.ld, ct, ldc); break;
        default: bf16_tokens<4>(w.n_block(nb), kblocks, x, a.ld, ct, ldc); break;
      }
    }
  }
}

// 16 exact int32 dots from four vpmaddwd accumulators (each: 4 outputs x 2 partial sums).
inline void reduce16(const __m256i* d, __m256i* out) {
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  out[0] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(d[0], d[1]), order);
  out[1] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(d[2], d[3]), order);
}

// 8 lanes of int4 metadata (bf16) as floats.
inline __m256 bf16x8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

template <bool kInt4>
void fix_up(const PackedMatrix& w, int nb, int g, const uint16_t* meta, const ActView& a, int t,
            __m256i* dot, __m256* acc) {
  __m256i sums[2];
  reduce16(dot, sums);
  const size_t at = (size_t(nb) * w.num_groups() + g) * kBlockN, ga = size_t(t) * a.ldg + g;
  const __m256 sx = _mm256_set1_ps(a.scale[ga]), bx = _mm256_set1_ps(a.bias[ga]);
  for (int h = 0; h < 2; ++h) {
    const __m256 sw = kInt4 ? bf16x8(meta + 8 * h) : _mm256_loadu_ps(w.scale + at + 8 * h);
    const __m256 swq =
        kInt4 ? bf16x8(meta + 16 + 8 * h) : _mm256_loadu_ps(w.scale_qsum + at + 8 * h);
    acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[h]), _mm256_mul_ps(sw, sx), acc[h]);
    acc[h] = _mm256_fmadd_ps(swq, bx, acc[h]);
    if (kInt4)
      acc[h] = _mm256_fmadd_ps(bf16x8(meta + 32 + 8 * h), _mm256_set1_ps(a.sum[ga]), acc[h]);
  }
  for (int i = 0; i < 4; ++i) dot[i] = _mm256_setzero_si256();
}

// Signed 16-byte chunk `q` (4 outputs x 4 k) of int8 row r (0..15) of a 64-k block.
template <bool kInt4>
inline __m128i row_chunk(const uint8_t* blk, int r, int q) {
  if (!kInt4) return _mm_load_si128(reinterpret_cast<const __m128i*>(blk + r * 64 + q * 16));
  const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(blk + (r % 8) * 64 + q * 16));
  const __m128i nib = r < 8 ? v : _mm_srli_epi16(v, 4);
  return _mm_sub_epi8(_mm_and_si128(nib, _mm_set1_epi8(0x0F)), _mm_set1_epi8(8));
}

template <bool kInt4>
void int_token(const PackedMatrix& w, int nb, const ActView& a, int t, float* c) {
  const int kblocks = w.num_k_blocks(), gs = w.group_size;
  const uint8_t* x = a.u8 + size_t(t) * a.ld;
  // Blocks walked by pointer as in avx512.cpp (int4 metadata after each run's last block).
  const int kpr = kInt4 ? w.run_k() / 64 : 1, kb_per_group = gs / 64;
  const size_t meta_bytes = kInt4 ? w.run_bytes() - size_t(kpr) * 512 : 0;
  const uint8_t* blk = w.n_block(nb);
  int in_run = 0, in_group = 0;
  __m256i lo[4], hi[4];
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int i = 0; i < 4; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
  for (int kb = 0; kb < kblocks; ++kb, blk += w.block_bytes()) {
    for (int r = 0; r < 16; ++r) {
      const __m128i x4 = _mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(x + kb * 64 + r * 4));
      const __m256i xw = _mm256_broadcastq_epi64(_mm_cvtepu8_epi16(x4));
      __m256i* d = r < 8 ? lo : hi;
      for (int q = 0; q < 4; ++q)
        d[q] = _mm256_add_epi32(
            d[q], _mm256_madd_epi16(_mm256_cvtepi8_epi16(row_chunk<kInt4>(blk, r, q)), xw));
    }
    const uint16_t* meta = reinterpret_cast<const uint16_t*>(blk + 512);
    if (gs == 32) {
      fix_up<kInt4>(w, nb, 2 * kb, meta, a, t, lo, acc);
      fix_up<kInt4>(w, nb, 2 * kb + 1, meta + 48, a, t, hi, acc);
    } else if (++in_group == kb_per_group) {
      in_group = 0;
      for (int i = 0; i < 4; ++i) {
        lo[i] = _mm256_add_epi32(lo[i], hi[i]);
        hi[i] = _mm256_setzero_si256();
      }
      fix_up<kInt4>(w, nb, (kb + 1) / kb_per_group - 1, meta, a, t, lo, acc);
    }
    if (kInt4 && ++in_run == kpr) {
      in_run = 0;
      blk += meta_bytes;
    }
  }
  _mm256_storeu_ps(c, acc[0]);
  _mm256_storeu_ps(c + 8, acc[1]);
}

template <bool kInt4>
void gemm_int(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
              size_t ldc) {
  for (int nb = nb_begin; nb < nb_end; ++nb)
    for (int t = 0; t < a.m; ++t)
      int_token<kInt4>(w, nb, a, t, c + size_t(t) * ldc + (nb - nb_begin) * 16);
}

}  // namespace

const IsaKernels& avx2_kernels() {
  static const IsaKernels k{"avx2", gemm_bf16, gemm_int<false>, gemm_int<true>,
                            avx2_gemm_fp8,
                            {silu_mul_row, to_bf16_row, to_u8_row, axpy_row}};
  return k;
}

}  // namespace hetmoe
