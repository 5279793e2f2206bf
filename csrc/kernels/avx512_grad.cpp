// AVX-512 backward kernels: a 12-row x 32-column fp32 FMA register tile (24 accumulators, two
// panel loads and 12 broadcasts per k); n-block columns unpacked in registers a block row at a
// time (bf16 shifted, int8 / int4 sign-extended or masked, fp8 widened through bf16, each times
// its group's scale), rows by 16 x 16 register transposes of those columns.
#include <immintrin.h>

#include <algorithm>

#include "kernels/grad_silu.h"
#include "kernels/fp8_avx512.h"
#include "kernels/grad.h"

namespace hetmoe {
namespace {

constexpr int kTileRows = 12;

inline __m512 bf16_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 bf16_odd(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// 16 lanes of int4 metadata (bf16) as floats.
inline __m512 bf16x16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// A bf16 or fp8 block row holds k and k + 1 of the 16 n in its even and odd 16-bit lanes.
void cols_pairs(const PackedMatrix& w, int nb, int k0, int k1, float* out, size_t ld) {
  const bool fp8 = w.fp8();
  const __m512i subnormals = fp8 ? fp8_subnormal_table() : _mm512_setzero_si512();
  for (int k = k0; k < k1; k += 2) {
    __m512i v;
    __m512 scale = _mm512_set1_ps(1.0f);
    if (fp8) {
      v = fp8x32_to_bf16(w.n_block(nb) + size_t(k / 2) * 32, subnormals);
      scale = _mm512_loadu_ps(w.scale + (size_t(nb) * w.num_groups() + k / w.group_size) * 16);
    } else {
      v = _mm512_loadu_si512(w.k_block(nb, k / 32) + (k % 32) * 32);
    }
    float* o = out + size_t(k - k0) * ld;
    _mm512_storeu_ps(o, _mm512_mul_ps(scale, bf16_even(v)));
    _mm512_storeu_ps(o + ld, _mm512_mul_ps(scale, bf16_odd(v)));
  }
}

// One group of an int n-block, dequantized in fp32 (int8 scale q, int4 scale q + bias): block row
// r (of a 64-k block) holds k = 4 r + c of the 16 n, a byte per (n, k); int4 the low (r < 8) or
// high nibbles of byte row r % 8. Shared by unpack_cols and pack_transposed.
template <bool kInt4>
struct IntGroup {
  __m512 scale, bias = _mm512_setzero_ps();
  IntGroup(const PackedMatrix& w, int nb, int g) {
    if (kInt4) {
      const uint16_t* meta = w.meta(nb, g);
      scale = bf16x16(meta);
      bias = bf16x16(meta + 32);
    } else {
      scale = _mm512_loadu_ps(w.scale + (size_t(nb) * w.num_groups() + g) * 16);
    }
  }
  // Block row r of the 64-k block at blk, its k in the 4 bytes of each lane.
  static __m512i row(const uint8_t* blk, int r) {
    if (!kInt4) return _mm512_loadu_si512(blk + r * 64);
    const __m512i v = _mm512_loadu_si512(blk + (r % 8) * 64);
    return r >= 8 ? _mm512_srli_epi32(v, 4) : v;
  }
  // The 16 weights of k = 4 r + c from row(blk, r).
  __m512 lane(__m512i v, int c) const {
    const __m128i shift = _mm_cvtsi32_si128(kInt4 ? 8 * c : 24 - 8 * c);
    __m512i q;
    if (kInt4)
      q = _mm512_sub_epi32(_mm512_and_si512(_mm512_srl_epi32(v, shift), _mm512_set1_epi32(0xF)),
                           _mm512_set1_epi32(8));
    else
      q = _mm512_srai_epi32(_mm512_sll_epi32(v, shift), 24);
    const __m512 f = _mm512_cvtepi32_ps(q);
    return kInt4 ? _mm512_fmadd_ps(scale, f, bias) : _mm512_mul_ps(scale, f);
  }
};

template <bool kInt4>
void cols_int(const PackedMatrix& w, int nb, int k0, int k1, float* out, size_t ld) {
  for (int k = k0; k < k1;) {  // a group at a time: its scale (and bias) loaded once
    const int g = k / w.group_size, end = std::min(k1, (g + 1) * w.group_size);
    const IntGroup<kInt4> group(w, nb, g);
    for (; k < end; k += 4) {
      const __m512i v = IntGroup<kInt4>::row(w.k_block(nb, k / 64), (k % 64) / 4);
      for (int c = 0; c < 4; ++c)
        _mm512_storeu_ps(out + size_t(k - k0 + c) * ld, group.lane(v, c));
    }
  }
}

void unpack_cols_avx512(const PackedMatrix& w, int nb, int k0, int k1, float* out, size_t ld) {
  if (w.format == WeightFormat::kINT8) return cols_int<false>(w, nb, k0, k1, out, ld);
  if (w.format == WeightFormat::kINT4) return cols_int<true>(w, nb, k0, k1, out, ld);
  cols_pairs(w, nb, k0, k1, out, ld);
}

// in [16][16] -> out[n * ld + k] = in[k][n]
inline void transpose16(const float* in, float* out, size_t ld) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + 16 * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + i * ld, r[i]);
}

void unpack_rows_avx512(const PackedMatrix& w, int nb, int k0, int k1, float* out, size_t ld) {
  alignas(64) float cols[16 * 16];
  for (int k = k0; k < k1; k += 16) {
    unpack_cols_avx512(w, nb, k, k + 16, cols, 16);
    transpose16(cols, out + (k - k0), ld);
  }
}

// c[MR rows][16 NV] (+)= a[MR rows][depth] . b[depth][16 NV]
template <int MR, int NV>
void tile(int depth, const float* a, size_t lda, const float* b, float* c, size_t ldc,
          bool accumulate) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v)
      acc[i][v] = accumulate ? _mm512_loadu_ps(c + size_t(i) * ldc + 16 * v) : _mm512_setzero_ps();
  for (int r = 0; r < depth; ++r) {
    __m512 bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + size_t(r) * 16 * NV + 16 * v);
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(a[size_t(i) * lda + r]);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, bv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + size_t(i) * ldc + 16 * v, acc[i][v]);
}

template <int NV>
void gemm_cols(int m, int depth, const float* a, size_t lda, const float* b, float* c,
               size_t ldc, bool acc) {
  for (int i = 0; i < m; i += kTileRows) {
    const float* ai = a + size_t(i) * lda;
    float* ci = c + size_t(i) * ldc;
    switch (m - i >= kTileRows ? kTileRows : m - i) {
      case 1: tile<1, NV>(depth, ai, lda, b, ci, ldc, acc); break;
      case 2: tile<2, NV>(depth, ai, lda, b, ci, ldc, acc); break;
      case 3: tile<3, NV>(depth, ai, lda, b, ci, ldc, acc); break;
      case 4: tile<4, NV>(depth, ai, lda, b, ci, ldc, acc); break;
      case 5: tile<5, NV>(depth, ai, lda, b, ci, ldc, acc); break;
      case 6: tile<6, NV>(depth, ai, lda, b, ci, ldc, acc); break;
      case 7: tile<7, NV>(depth, ai, lda, b, ci, ldc, acc); break;
      case 8: tile<8, NV>(depth, ai, lda, b, ci, ldc, acc); break;
      case 9: tile<9, NV>(depth, ai, lda, b, ci, ldc, acc); break;
      case 10: tile<10, NV>(depth, ai, lda, b, ci, ldc, acc); break;
      case 11: tile<11, NV>(depth, ai, lda, b, ci, ldc, acc); break;
      default: tile<12, NV>(depth, ai, lda, b, ci, ldc, acc); break;
    }
  }
}

void gemm_avx512(int m, int depth, const float* a, size_t lda, const float* b, int cols,
                 float* c, size_t ldc, bool accumulate) {
  if (cols == 32) gemm_cols<2>(m, depth, a, lda, b, c, ldc, accumulate);
  else gemm_cols<1>(m, depth, a, lda, b, c, ldc, accumulate);
}

// bf16 bits of 16 floats rounded to nearest even, in the low (kHigh false) or high half of
// each 32-bit lane (layout/bf16.h float_to_bf16).
template <bool kHigh>
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return kHigh ? _mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u)))
               : _mm512_srli_epi32(r, 16);
}

// 8 rows of 8 qwords -> their transpose (row c = qword c of each row), each qword's middle
// 16-bit words swapped: 2 x 2 bf16 blocks from row-major to column-major (pack_transposed).
inline void transpose_pairs(const __m512i* r, uint8_t* out) {
  __m512i t[8], u[4];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_epi64(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi64(r[i], r[i + 1]);
  }
  const __m512i swap = _mm512_set4_epi32(0x0F0E0B0A, 0x0D0C0908, 0x07060302, 0x05040100);
  for (int odd = 0; odd < 2; ++odd) {
    u[0] = _mm512_shuffle_i64x2(t[odd], t[2 + odd], 0x88);
    u[1] = _mm512_shuffle_i64x2(t[odd], t[2 + odd], 0xDD);
    u[2] = _mm512_shuffle_i64x2(t[4 + odd], t[6 + odd], 0x88);
    u[3] = _mm512_shuffle_i64x2(t[4 + odd], t[6 + odd], 0xDD);
    const __m512i c[4] = {_mm512_shuffle_i64x2(u[0], u[2], 0x88),   // column odd
                          _mm512_shuffle_i64x2(u[1], u[3], 0x88),   // odd + 2
                          _mm512_shuffle_i64x2(u[0], u[2], 0xDD),   // odd + 4
                          _mm512_shuffle_i64x2(u[1], u[3], 0xDD)};  // odd + 6
    for (int i = 0; i < 4; ++i)
      _mm512_store_si512(out + (odd + 2 * i) * 64, _mm512_shuffle_epi8(c[i], swap));
  }
}

// bf16_rows of an int n-block: its 8 block rows of the 32 columns, each 4 k of the 16 n.
template <bool kInt4>
void int_bf16_rows(const PackedMatrix& w, int nb, int k0, int g, __m512i* rows) {
  const IntGroup<kInt4> group(w, nb, g);
  const uint8_t* blk = w.k_block(nb, k0 / 64);
  for (int r = 0; r < 8; ++r) {
    const __m512i v = IntGroup<kInt4>::row(blk, (k0 % 64) / 4 + r);
    rows[2 * r] = _mm512_or_si512(bf16_bits<false>(group.lane(v, 0)),
                                  bf16_bits<true>(group.lane(v, 1)));
    rows[2 * r + 1] = _mm512_or_si512(bf16_bits<false>(group.lane(v, 2)),
                                      bf16_bits<true>(group.lane(v, 3)));
  }
}

// The bf16 block rows (packed_matrix.h: 16 n x a k pair each) of columns [k0, k0 + 32) of
// n-block nb, dequantized as unpack_cols does (in fp32: int8 scale q, int4 scale q + bias, fp8
// scale e4m3) and rounded to nearest even; bf16 as packed.
void bf16_rows(const PackedMatrix& w, int nb, int k0, __m512i* rows) {
  if (w.format == WeightFormat::kBF16) {
    const uint8_t* blk = w.k_block(nb, k0 / 32);
    for (int r = 0; r < 16; ++r) rows[r] = _mm512_load_si512(blk + r * 64);
    return;
  }
  const int g = k0 / w.group_size;  // one group: groups are 32 k or wider, k0 a multiple of 32
  if (w.fp8()) {
    const __m512i subnormals = fp8_subnormal_table();
    const __m512 scale = _mm512_loadu_ps(w.scale + (size_t(nb) * w.num_groups() + g) * 16);
    for (int r = 0; r < 16; ++r) {  // k pair k0 / 2 + r: 32 codes
      const __m512i v = fp8x32_to_bf16(w.n_block(nb) + size_t(k0 / 2 + r) * 32, subnormals);
      rows[r] = _mm512_or_si512(bf16_bits<false>(_mm512_mul_ps(scale, bf16_even(v))),
                                bf16_bits<true>(_mm512_mul_ps(scale, bf16_odd(v))));
    }
    return;
  }
  if (w.int4()) return int_bf16_rows<true>(w, nb, k0, g, rows);
  int_bf16_rows<false>(w, nb, k0, g, rows);
}

constexpr int kPrefetchAhead = 8;

// W^T's bf16 block (j, r / 32) holds rows r, r + 1 of W (a pair) in its tile row (r % 32) / 2:
// 16 columns k0 + 16 j .. of each, as [column][r % 2] bf16 (packed_matrix.h). From W's bf16
// block rows (bf16_rows) that is a transpose of 2 x 2 blocks (transpose_pairs).
void pack_transposed_avx512(const PackedMatrix& w, int k0, uint8_t* out) {
  const int kt = int(round_up(size_t(w.n), 64));
  const size_t nb_bytes = size_t(kt / 32) * 1024;  // one n-block of W^T
  const int nblocks = w.n / kBlockN, kb = k0 / w.k_block();
  for (int nb = 0; nb < nblocks; ++nb) {
    // The n-blocks lie a row of W apart: no hardware prefetcher follows that stride, so the
    // k-block of the n-block kPrefetchAhead on is fetched now (a quantized one holds the next
    // panel's columns too).
    if (nb + kPrefetchAhead < nblocks) {
      const char* ahead = reinterpret_cast<const char*>(w.k_block(nb + kPrefetchAhead, kb));
      for (size_t b = 0; b < w.block_bytes(); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    __m512i r[16];
    bf16_rows(w, nb, k0, r);
    uint8_t* dst = out + size_t(nb / 2) * 1024 + size_t(nb % 2) * 512;
    transpose_pairs(r, dst);
    transpose_pairs(r + 8, dst + nb_bytes);
  }
  for (int r = w.n; r < kt; r += 2)
    for (int j = 0; j < 2; ++j)
      _mm512_store_si512(out + j * nb_bytes + size_t(r / 32) * 1024 + size_t(r % 32 / 2) * 64,
                         _mm512_setzero_si512());
}

}  // namespace

const GradKernels& avx512_grad_kernels() {
  static const GradKernels k{"avx512", unpack_cols_avx512, unpack_rows_avx512, gemm_avx512,
                             silu_sig_row, pack_transposed_avx512};
  return k;
}

}  // namespace hetmoe
