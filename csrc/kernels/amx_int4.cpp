// AMX int4 kernel for many tokens per expert (prefill), on the bf16 tile loop of amx.cpp
// (bf16_pair, amx_tiles.h): the weights widened to bf16 B tiles pair by pair, the next pair's
// beside the tile unit's work on this one (Int4Widener).
#include <immintrin.h>

#include "kernels/amx_tiles.h"
#include "kernels/gemm.h"

namespace hetmoe {
namespace {

// 16 lanes of int4 metadata (bf16) as floats.
inline __m512 bf16x16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Int4 on AMX through bf16 tiles. Int4's groups of 32 would need an int32 tile stored and fixed
// up in fp32 per 32 inputs (4x int8's, and each fix-up costs about what the tdpbusd do), so the
// int path ran at under half of int8's rate. Instead both operands are dequantized once per call
// to bf16 and multiplied without fix-ups: each n-block pair's weights to w = sw * (q - 8) + bw of
// their group, the rows to x = sx * u + bx of theirs (the values the int path multiplies
// exactly), each rounded to bf16 (relative 2^-9, against int4's ~2^-4 steps). The floats
// therefore differ from the int kernels of the other ISAs by that rounding.

// 16 bytes as floats.
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Rows [0, round_up(m, 16)) of u8 view `a` (groups of gs, K = k) dequantized to bf16 A tiles in
// tile order, [mp / 16][k / 32][16 rows][32].
const uint8_t* dequant_rows(const ActView& a, int k, int gs) {
  const int mp = int(round_up(a.m, 16)), chunks = k / 32;
  uint8_t* out = aligned_scratch(size_t(mp) * k * 2, 1);
  const size_t step = size_t(a.tile_step);
  for (int tb = 0; tb < mp / 16; ++tb)
    for (int ch = 0; ch < chunks; ++ch) {
      const int k0 = ch * 32, g = k0 / gs;
      uint8_t* dst = out + (size_t(tb) * chunks + ch) * 1024;
      for (int r = 0; r < 16; ++r) {
        const size_t row = size_t(tb) * 16 + r;
        const uint8_t* src = step ? a.u8 + size_t(tb) * 16 * a.ld + k0 / step * 16 * step +
                                        r * step + k0 % step
                                  : a.u8 + row * a.ld + k0;
        const __m512 sx = _mm512_set1_ps(a.scale[row * a.ldg + g]);
        const __m512 bx = _mm512_set1_ps(a.bias[row * a.ldg + g]);
        const __m512 lo = _mm512_fmadd_ps(u8x16(src), sx, bx);
        const __m512 hi = _mm512_fmadd_ps(u8x16(src + 16), sx, bx);
        _mm512_store_si512(dst + r * 64, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
  return out;
}

// Int4 n-blocks widened to bf16 B tiles as the bf16 format packs them, [k / 32][16 k-pairs]
// [16 n][2]: w = sw * (q - 8) + bw of its group, rounded to bf16. Each packed 64-byte row holds
// rows r (low nibbles) and r + 8 (high) of a 64-k block, each [16 n][4 k], which become two
// k-pair rows of a 32-k B tile. A pair of n-blocks is widened one such row at a time (`step`:
// a slice per k-step of the previous pair's tile loop), so the vector units widen the next pair
// while the tile unit multiplies this one: widened first, then multiplied, the two took turns
// and at 32 tokens per expert the widening (flat in tokens) was about as long as the tile work.
//
// A row's nibbles become floats without integer conversion: each nibble q is put into bits
// 19-22 of a float whose other bits are those of 1.0, which is 1 + q / 16 exactly, so w =
// 16 sw * f + (bw - 24 sw) in one fma (the constant rounded once to fp32: 2^-24 of |bw - 24 sw|,
// far under bf16's 2^-9). One two-source byte permute builds 16 such floats straight from the
// row (the nibble's byte beside constant bytes), in the order the B tile wants, so no lane is
// reordered after the bf16 rounding: 4 permutes, 4 fmas and 2 roundings a row.
class Int4Widener {
 public:
  explicit Int4Widener(const PackedMatrix& w)
      : addr_(w), rows_(w.num_k_blocks() * 16), group_mask_(w.group_size - 1),
        group_shift_(__builtin_ctz(w.group_size)), out_bytes_(size_t(w.k / 32) * 1024) {
    // Float lane i of the four: n = i / 2 (+ 8 for j = 1, 3), k = i % 2 (+ 2 for j = 2, 3) of
    // the row's [16 n][4 k] bytes; a float's bytes: 0x00, 0x00, the nibble's, 0x3F.
    alignas(64) uint8_t idx[4][64];
    alignas(64) int32_t spread[2][16];
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 16; ++i) {
        const int n = i / 2 + (j % 2) * 8, k = i % 2 + (j / 2) * 2;
        idx[j][4 * i] = idx[j][4 * i + 1] = 64;  // byte 0 of the constant table: 0x00
        idx[j][4 * i + 2] = uint8_t(n * 4 + k);
        idx[j][4 * i + 3] = 65;                  // byte 1 of the constant table: 0x3F
      }
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 16; ++i) spread[h][i] = i / 2 + 8 * h;
    for (int j = 0; j < 4; ++j) idx_[j] = _mm512_load_si512(idx[j]);
    for (int h = 0; h < 2; ++h) spread_[h] = _mm512_load_si512(spread[h]);
    table_ = _mm512_set1_epi32(0x3F00);
  }

  // Bytes of one widened n-block.
  size_t bytes() const { return out_bytes_; }

  // Widens n-block nb (and nb + 1 when two_n) into out (and out + bytes()) over `steps` calls
  // of step(); finish() widens what they left.
  void start(int nb, bool two_n, uint8_t* out, size_t steps) {
    nb_ = nb;
    nblock_ = addr_.n_block(nb);
    out_ = out;
    b_ = kb_ = r_ = 0;
    left_ = size_t(rows_) * (two_n ? 2 : 1);
    per_step_ = steps ? (left_ + steps - 1) / steps : left_;
  }
  void step() {
    for (size_t i = 0; i < per_step_ && left_; ++i) next();
  }
  void finish() {
    while (left_) next();
  }

 private:
  // Row r_ of k-block kb_ of n-block nb_ + b_, then the counters on (no divisions per row:
  // PackedMatrix's k_block and meta divide by the run and group sizes; Int4Addr shifts).
  void next() {
    if (r_ == 0) blk_ = addr_.k_block(nblock_, kb_);
    const int k = kb_ * 64 + 4 * r_;
    if ((k & group_mask_) == 0) {  // a group starts (sizes are powers of two)
      const uint16_t* meta = addr_.meta(nblock_, k >> group_shift_);
      const __m512 s = bf16x16(meta), bias = bf16x16(meta + 32);
      const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(16.0f));
      const __m512 shift = _mm512_fmadd_ps(s, _mm512_set1_ps(-24.0f), bias);
      for (int h = 0; h < 2; ++h) {
        sw_[h] = _mm512_permutexvar_ps(spread_[h], scale);
        bw_[h] = _mm512_permutexvar_ps(spread_[h], shift);
      }
    }
    widen_row(out_ + b_ * bytes() + size_t(k / 32) * 1024 + size_t(2 * r_ % 16) * 64);
    --left_;
    if (++r_ == 16) {
      r_ = 0;
      if (++kb_ * 16 == rows_) kb_ = 0, ++b_, nblock_ = addr_.n_block(nb_ + b_);
    }
  }

  // The current row (r_ of blk_) widened into dst: its k-pairs (k0, k1) and, 64 bytes on,
  // (k2, k3).
  void widen_row(uint8_t* dst) {
    const __m512i v = _mm512_load_si512(blk_ + (r_ % 8) * 64);
    // Each byte's nibble to bits 3-6 (16-bit shifts: the bits they carry across bytes are
    // masked), bit 7 set: the third byte of 1 + q / 16.
    const __m512i sh = r_ < 8 ? _mm512_slli_epi16(v, 3) : _mm512_srli_epi16(v, 1);
    const __m512i q = _mm512_ternarylogic_epi32(sh, _mm512_set1_epi8(0x78),
                                                _mm512_set1_epi8(char(0x80)), 0xEA);
    __m512 f[4];
    for (int j = 0; j < 4; ++j)
      f[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_permutex2var_epi8(q, idx_[j], table_)),
                             sw_[j % 2], bw_[j % 2]);
    _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
    _mm512_store_si512(dst + 64, (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]));
  }

  const Int4Addr addr_;
  const int rows_;  // packed rows per n-block
  const int group_mask_, group_shift_;
  const size_t out_bytes_;
  __m512i idx_[4], spread_[2], table_;
  __m512 sw_[2], bw_[2];  // the current group's 16 sw and bw - 24 sw, spread to n of lanes i / 2
  uint8_t* out_ = nullptr;
  const uint8_t* nblock_ = nullptr;  // the current n-block
  const uint8_t* blk_ = nullptr;     // the current k-block's packed rows
  int nb_ = 0, b_ = 0, kb_ = 0, r_ = 0;
  size_t left_ = 0, per_step_ = 0;  // rows still to widen; rows per step()
};

// Per k-step of a pair's tile loop: the L2 prefetch of the pair after next, and a slice of the
// next pair's widening.
struct WidenAhead {
  Prefetch pf;
  Int4Widener& widen;
  void step() {
    pf.step();
    widen.step();
  }
};

}  // namespace

void amx_gemm_int4(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
                   size_t ldc) {
  configure(64);
  const int kbs = w.k / 32, pairs = (a.m + 31) / 32;
  const size_t steps = size_t(kbs) * pairs;  // bf16_pair's k-steps
  const uint8_t* x = dequant_rows(a, w.k, w.group_size);
  Int4Widener widen(w);
  const size_t nbytes = widen.bytes();
  uint8_t* wide = aligned_scratch(4 * nbytes, 0);  // two pairs: this one's, the next's
  float* cbuf = reinterpret_cast<float*>(aligned_scratch(size_t(pairs) * 4096, 2));
  const bool stream = a.stream_c && streamable(c, ldc);
  widen.start(nb_begin, nb_begin + 1 < nb_end, wide, 0);
  widen.finish();
  for (int nb = nb_begin, p = 0; nb < nb_end; nb += 2, p ^= 1) {
    const bool two_n = nb + 1 < nb_end;
    const uint8_t* cur = wide + size_t(p) * 2 * nbytes;
    if (nb + 2 < nb_end)
      widen.start(nb + 2, nb + 3 < nb_end, wide + size_t(p ^ 1) * 2 * nbytes, steps);
    WidenAhead ahead{next_pair(w, nb + 2, nb_end, steps), widen};
    bf16_pair(x, nbytes, a.m, cur, cur + nbytes, two_n, kbs, ahead, cbuf,
              c + (nb - nb_begin) * 16, ldc, stream);
    widen.finish();
  }
  sfence_if(stream);
  _tile_release();
}

}  // namespace hetmoe
