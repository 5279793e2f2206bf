// AMX int4 kernel on int8 tiles (opt-in, HETMOE_AMX_INT4=i8: amx.cpp). Both operands go onto
// one int8 grid each, so the whole K runs as tdpbusd into int32 with one scale per output and no
// per-group fix-ups: the int8 tile rate (about 2x bf16's per tile op) instead of amx_int4.cpp's
// bf16 loop and its fp32 widening.
// - Rows: the call's u8 rows (x = sx u + bx per group) requantized once per call to symmetric
//   int8 per row over all K, x ~ rs * x8 with rs = max |x| / 127, stored as u = x8 + 128 (u8 for
//   tdpbusd) in tile order; sum u w8 - 128 sum w8 = sum x8 w8.
// - Weights: per output channel n one grid S_n = (largest |sw (q - 8) + bw| over its groups) /
//   127, from the group metadata alone; each nibble remapped to w8 = round(w / S_n) in fixed
//   point on 16-bit lanes, w8 = (alpha + beta q) >> 8 with alpha = round(256 (bw - 8 sw) / S_n)
//   + 128 and beta = round(256 sw / S_n) per (n, group): at most 1/2 + 8/256 of a step of S_n
//   from w (the rounding of alpha and of 15 beta, 8/256 at most, on top of the nearest integer).
// - c = (sum u w8 - 128 colsum_n) * rs * S_n.
// An n-block pair is remapped into int8 B tiles one packed row at a time, sliced over the
// previous pair's k-steps (as Int4Widener in amx_int4.cpp), so the vector units remap the next
// pair while the tile unit multiplies this one.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/amx_tiles.h"
#include "kernels/gemm.h"

namespace hetmoe {
namespace {

// |u w8| <= 255 * 127 per product: int32 sums hold K of at most kAmxInt4I8MaxK.
static_assert(int64_t(kAmxInt4I8MaxK) * 255 * 127 <= int64_t(INT32_MAX), "int32 overflow");

// 16 lanes of int4 metadata (bf16) as floats.
inline __m512 bf16x16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Row r of u8 view `a` (k bytes) copied row-major into `row` (views in tile order are gathered).
void read_row(const ActView& a, int r, int k, uint8_t* row) {
  if (!a.tile_step) {
    std::memcpy(row, a.u8 + size_t(r) * a.ld, size_t(k));
    return;
  }
  const size_t step = size_t(a.tile_step);
  const uint8_t* base = a.u8 + size_t(r / 16) * 16 * a.ld + size_t(r % 16) * step;
  for (size_t k0 = 0; k0 < size_t(k); k0 += step)
    std::memcpy(row + k0, base + k0 / step * 16 * step, step);
}

// The call's rows as u8 A tiles of 64 k in tile order, [mp / 16][k / 64][16][64], and the row
// scales rs[mp] (rows >= m: u = 128, rs = 0).
struct QuantRows {
  const uint8_t* x;
  const float* rs;
};

QuantRows quantize_rows(const ActView& a, int k, int gs) {
  const int mp = int(round_up(a.m, 16)), kbs = k / 64;
  uint8_t* out = aligned_scratch(size_t(mp) * k + size_t(mp) * 4 + size_t(k) * 5, 1);
  float* rs = reinterpret_cast<float*>(out + size_t(mp) * k);
  float* xf = rs + mp;                                   // one row dequantized, [k]
  uint8_t* u = reinterpret_cast<uint8_t*>(xf + k);       // one row's u8, [k]
  const __m512i zp = _mm512_set1_epi32(128);
  for (int r = 0; r < mp; ++r) {
    __m512 amax = _mm512_setzero_ps();
    if (r < a.m) {
      read_row(a, r, k, u);
      for (int k0 = 0; k0 < k; k0 += 16) {
        const size_t g = size_t(r) * a.ldg + size_t(k0 / gs);
        const __m512 v = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + k0))));
        const __m512 x = _mm512_fmadd_ps(v, _mm512_set1_ps(a.scale[g]), _mm512_set1_ps(a.bias[g]));
        _mm512_storeu_ps(xf + k0, x);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(x));
      }
    }
    const float mx = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(mx > 0 ? 127.0f / mx : 0.0f);
    rs[r] = mx / 127.0f;
    for (int k0 = 0; k0 < k; k0 += 16) {
      const __m512i q = r < a.m ? _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xf + k0), inv))
                                : _mm512_setzero_si512();
      uint8_t* dst = out + (size_t(r / 16) * kbs + k0 / 64) * 1024 + (r % 16) * 64 + k0 % 64;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                       _mm512_cvtepi32_epi8(_mm512_add_epi32(q, zp)));
    }
  }
  return {out, rs};
}

// An n-block pair's output terms: S_n and the zero-point correction 128 colsum_n per lane.
struct PairScales {
  alignas(64) float s[2][16];
  alignas(64) int32_t corr[2][16];
};

// Int4 n-blocks remapped to int8 B tiles as the int8 format packs them, [k / 64][16 k/4][16 n]
// [4]. Each packed 64-byte row r < 8 of a 64-k block holds B rows r (low nibbles) and r + 8
// (high). start() computes the pair's grids; step() remaps a slice of its rows (per k-step of
// the previous pair's tile loop), finish() the rest.
class Int8Remap {
 public:
  explicit Int8Remap(const PackedMatrix& w)
      : w_(w), addr_(w), rows_(w.num_k_blocks() * 8), group_shift_(__builtin_ctz(w.group_size)),
        out_bytes_(size_t(w.k) * 16) {
    alignas(64) int16_t twice[32];
    for (int i = 0; i < 32; ++i) twice[i] = int16_t(i / 2);
    twice_ = _mm512_load_si512(twice);
  }

  // Bytes of one remapped n-block.
  size_t bytes() const { return out_bytes_; }

  void start(int nb, bool two_n, uint8_t* out, PairScales* ps, size_t steps) {
    nb_ = nb;
    nblock_ = addr_.n_block(nb);
    out_ = out;
    ps_ = ps;
    b_ = kb_ = r_ = 0;
    const int nn = two_n ? 2 : 1;
    for (int b = 0; b < nn; ++b) grid(b);
    left_ = size_t(rows_) * nn;
    per_step_ = steps ? (left_ + steps - 1) / steps : left_;
  }
  void step() { for (size_t i = 0; i < per_step_ && left_; ++i) next(); }
  void finish() { while (left_) next(); }

 private:
  // S_n of n-block nb_ + b: the largest dequantized magnitude over its groups (the ends q = 0
  // and q = 15 of each group's line) over 127; 0 for an all-zero channel (its w8 are 0).
  void grid(int b) {
    const __m512 eight = _mm512_set1_ps(8), seven = _mm512_set1_ps(7);
    __m512 mx = _mm512_setzero_ps();
    for (int g = 0; g < w_.num_groups(); ++g) {
      const uint16_t* meta = w_.meta(nb_ + b, g);
      const __m512 s = bf16x16(meta), bias = bf16x16(meta + 32);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_sub_ps(bias, _mm512_mul_ps(eight, s))));
      mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_add_ps(bias, _mm512_mul_ps(seven, s))));
    }
    _mm512_store_ps(ps_->s[b], _mm512_div_ps(mx, _mm512_set1_ps(127)));
    const __mmask16 live = _mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ);
    inv_[b] = _mm512_maskz_div_ps(live, _mm512_set1_ps(127), mx);
    sum_[b] = _mm512_setzero_si512();
  }

  // alpha and beta of group g of n-block nb_ + b_ as 32 int16 lanes (each n's twice: a word
  // holds two k of one n).
  void constants(int g, __m512i& alpha, __m512i& beta) const {
    const uint16_t* meta = addr_.meta(nblock_, g);
    const __m512 s = bf16x16(meta), bias = bf16x16(meta + 32), k256 = _mm512_set1_ps(256);
    const __m512 inv = _mm512_mul_ps(inv_[b_], k256);
    const __m512 a = _mm512_add_ps(
        _mm512_mul_ps(_mm512_sub_ps(bias, _mm512_mul_ps(_mm512_set1_ps(8), s)), inv),
        _mm512_set1_ps(128));
    const __m512i ai = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_cvtps_epi32(a)));
    const __m512i bi = _mm512_castsi256_si512(
        _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(s, inv))));
    alpha = _mm512_permutexvar_epi16(twice_, ai);
    beta = _mm512_permutexvar_epi16(twice_, bi);
  }

  // Packed row r_ of k-block kb_ of n-block nb_ + b_ into its two B rows, then the counters on
  // (addresses and groups by shifts, Int4Addr: no divisions per k-block).
  void next() {
    if (r_ == 0) {
      blk_ = addr_.k_block(nblock_, kb_);
      const int k = kb_ * 64;
      if (((k >> group_shift_) << group_shift_) == k || group_shift_ < 6) {
        // low nibbles: k .. k + 31, high: k + 32 .. k + 63
        constants(k >> group_shift_, alpha_[0], beta_[0]);
        constants((k + 32) >> group_shift_, alpha_[1], beta_[1]);
      }
    }
    const __m512i v = _mm512_load_si512(blk_ + r_ * 64);
    const __m512i low4 = _mm512_set1_epi16(0x000F);
    uint8_t* dst = out_ + b_ * bytes() + size_t(kb_) * 1024 + size_t(r_) * 64;
    remap(_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 8), low4), 0, dst);
    remap(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_srli_epi16(v, 12), 1,
          dst + 8 * 64);
    --left_;
    if (++r_ == 8) {
      r_ = 0;
      if (++kb_ * 8 == rows_) {
        _mm512_store_si512(ps_->corr[b_], _mm512_slli_epi32(sum_[b_], 7));
        kb_ = 0, ++b_, nblock_ = addr_.n_block(nb_ + b_);
      }
    }
  }

  // One B row from the nibbles of its even bytes (qe) and odd bytes (qo) as words, on the
  // constants of half h: w8 = (alpha + beta q) >> 8 (wrapping 16-bit products: the true sum
  // lies within int16, so the wrapped one is exact), the even results' high bytes and the odd
  // ones' merged into bytes; the channel sums go on.
  void remap(__m512i qe, __m512i qo, int h, uint8_t* dst) {
    const __m512i te = _mm512_add_epi16(alpha_[h], _mm512_mullo_epi16(beta_[h], qe));
    const __m512i to = _mm512_add_epi16(alpha_[h], _mm512_mullo_epi16(beta_[h], qo));
    const __m512i w8 = _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, _mm512_srli_epi16(te, 8), to);
    _mm512_store_si512(dst, w8);
    sum_[b_] = _mm512_dpbusd_epi32(sum_[b_], _mm512_set1_epi8(1), w8);
  }

  const PackedMatrix& w_;
  const Int4Addr addr_;
  const int rows_;  // packed rows per n-block
  const int group_shift_;  // log2 of the group size
  const size_t out_bytes_;
  __m512i twice_;
  __m512 inv_[2];                       // 127 / (largest magnitude) per n-block of the pair
  __m512i sum_[2];                      // sum of w8 per channel
  __m512i alpha_[2], beta_[2];          // [low, high nibbles] of the current k-block
  uint8_t* out_ = nullptr;
  PairScales* ps_ = nullptr;
  const uint8_t* nblock_ = nullptr;  // n-block nb_ + b_
  const uint8_t* blk_ = nullptr;
  int nb_ = 0, b_ = 0, kb_ = 0, r_ = 0;
  size_t left_ = 0, per_step_ = 0;
};

// tile_products with tdpbusd over k-steps of 64: from zero (`first`) or from cb, stored back to
// cb (int32 tile 2 i + j at cb + 256 (2 i + j)).
template <int NT, int NN, class Step>
void int8_tiles(const uint8_t* a, size_t a_next, const uint8_t* b0, const uint8_t* b1, int steps,
                bool first, int32_t* cb, Step& pf) {
  tile_products<TileOp::kU8S8, NT, NN>(a, a_next, b0, b1, steps, first, cb, pf);
  store_c_tiles<NT, NN>(cb);
}

// C tiles of one token pair (nt x nn at cb) scaled into c: (sum - corr_n) * rs_row * S_n.
void scale_out(const int32_t* cb, int nt, int nn, const float* rs, const PairScales& ps,
               float* c, size_t ldc, bool stream) {
  for (int i = 0; i < nt; ++i)
    for (int r = 0; r < 16; ++r) {
      const __m512 row = _mm512_set1_ps(rs[16 * i + r]);
      for (int j = 0; j < nn; ++j) {
        const __m512i sum = _mm512_sub_epi32(_mm512_load_si512(cb + 256 * (2 * i + j) + 16 * r),
                                             _mm512_load_si512(ps.corr[j]));
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum),
                                       _mm512_mul_ps(row, _mm512_load_ps(ps.s[j])));
        float* dst = c + size_t(16 * i + r) * ldc + 16 * j;
        if (stream)
          _mm512_stream_ps(dst, v);
        else
          _mm512_storeu_ps(dst, v);
      }
    }
}

// One n-block pair (b0, and b1 when two_n: kbs int8 B tiles each) over the call's rows, K chunk
// outer and token pairs inner when there are several (the chunk's B tiles reused from L1), as
// bf16_pair does; c rows of the pair written once the last chunk is summed.
template <class Step>
void int8_pair(const QuantRows& x, int m, int kbs, const uint8_t* b0, const uint8_t* b1,
               bool two_n, const PairScales& ps, Step& pf, int32_t* cbuf, float* c, size_t ldc,
               bool stream) {
  const int chunk = m > 32 ? kChunkSteps : kbs;
  const size_t tile_stride = size_t(kbs) * 1024;
  for (int k0 = 0; k0 < kbs; k0 += chunk) {
    const int steps = std::min(chunk, kbs - k0);
    const bool first = k0 == 0, last = k0 + steps == kbs;
    const size_t koff = size_t(k0) * 1024;
    for (int t = 0; t < m; t += 32) {
      const uint8_t* at = x.x + size_t(t / 16) * tile_stride + koff;
      int32_t* cb = cbuf + size_t(t / 32) * 1024;
      const bool two_t = t + 16 < m;
      if (two_t && two_n)
        int8_tiles<2, 2>(at, tile_stride, b0 + koff, b1 + koff, steps, first, cb, pf);
      else if (two_t)
        int8_tiles<2, 1>(at, tile_stride, b0 + koff, b1 + koff, steps, first, cb, pf);
      else if (two_n)
        int8_tiles<1, 2>(at, tile_stride, b0 + koff, b1 + koff, steps, first, cb, pf);
      else
        int8_tiles<1, 1>(at, tile_stride, b0 + koff, b1 + koff, steps, first, cb, pf);
      if (last)
        scale_out(cb, two_t ? 2 : 1, two_n ? 2 : 1, x.rs + t, ps, c + size_t(t) * ldc, ldc,
                  stream);
    }
  }
}

// Per k-step of a pair's tile loop: the L2 prefetch of the pair after next, and a slice of the
// next pair's remap.
struct RemapAhead {
  Prefetch pf;
  Int8Remap& remap;
  void step() {
    pf.step();
    remap.step();
  }
};

}  // namespace

void amx_gemm_int4_i8(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end,
                      float* c, size_t ldc) {
  // Invariants, one compare each (layers past the K bound are refused when made: moe_layer.cpp).
  if (w.k % 64 || w.k % w.group_size || w.k > kAmxInt4I8MaxK || a.m <= 0 || nb_begin >= nb_end)
    throw std::logic_error("amx_gemm_int4_i8: K " + std::to_string(w.k) + ", group size " +
                           std::to_string(w.group_size) + ", m " + std::to_string(a.m) +
                           ", n-blocks [" + std::to_string(nb_begin) + ", " +
                           std::to_string(nb_end) + "): needs K % 64 == 0, K % group size == 0, "
                           "K <= " + std::to_string(kAmxInt4I8MaxK) + ", m > 0, n-blocks to do");
  configure(64);
  const int kbs = w.num_k_blocks(), pairs = (a.m + 31) / 32;
  const size_t steps = size_t(kbs) * pairs;  // int8_pair's k-steps
  const QuantRows x = quantize_rows(a, w.k, w.group_size);
  Int8Remap remap(w);
  const size_t nbytes = remap.bytes();
  uint8_t* wide = aligned_scratch(4 * nbytes, 0);  // two pairs: this one's, the next's
  int32_t* cbuf = reinterpret_cast<int32_t*>(aligned_scratch(size_t(pairs) * 4096, 2));
  PairScales ps[2];
  const bool stream = a.stream_c && streamable(c, ldc);
  remap.start(nb_begin, nb_begin + 1 < nb_end, wide, &ps[0], 0);
  remap.finish();
  for (int nb = nb_begin, p = 0; nb < nb_end; nb += 2, p ^= 1) {
    const bool two_n = nb + 1 < nb_end;
    const uint8_t* cur = wide + size_t(p) * 2 * nbytes;
    if (nb + 2 < nb_end)
      remap.start(nb + 2, nb + 3 < nb_end, wide + size_t(p ^ 1) * 2 * nbytes, &ps[p ^ 1], steps);
    RemapAhead ahead{next_pair(w, nb + 2, nb_end, steps), remap};
    int8_pair(x, a.m, kbs, cur, cur + nbytes, two_n, ps[p], ahead, cbuf,
              c + (nb - nb_begin) * 16, ldc, stream);
    remap.finish();
  }
  sfence_if(stream);
  _tile_release();
}

}  // namespace hetmoe
