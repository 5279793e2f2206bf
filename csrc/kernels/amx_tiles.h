// AMX tile plumbing shared by amx.cpp, amx_int4.cpp and amx_fp8.cpp (internal linkage: each
// file its own copy and its own per-thread scratch): tile configuration, scratch, activations in
// tile order, the software prefetch of the next n-block pair, the 2 x 2 tile loop (bf16, and
// int8 for amx_int4_i8.cpp) and the bf16 pass of one n-block pair over a call's rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "layout/packed_matrix.h"

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
inline void configure(int k_bytes) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  cfg.colsb[4] = cfg.colsb[5] = uint16_t(k_bytes);
  cfg.rows[6] = cfg.rows[7] = uint8_t(k_bytes / 4);
  _tile_loadconfig(&cfg);
}

// 64-byte aligned per-thread scratch; `slot` keeps separate buffers apart (0: C or int4 widened
// weights, 1: A in tile order, 2: int accumulators, 3: activation group terms by group).
inline uint8_t* aligned_scratch(size_t bytes, int slot) {
  thread_local std::vector<uint8_t> buf[4];
  if (buf[slot].size() < bytes + 64) buf[slot].resize(bytes + 64);
  const uintptr_t base = reinterpret_cast<uintptr_t>(buf[slot].data());
  return reinterpret_cast<uint8_t*>((base + 63) & ~uintptr_t(63));
}

// Rows [0, round_up(m, 16)) of row-major A (`row_bytes` used per row, `ld_bytes` apart) in tile
// order: [m / 16][row_bytes / step][16 rows][step bytes], so A tile (t, s) is 16 * step bytes.
// A view already in tile order (with tile row `step`) is returned as it lies.
inline const uint8_t* tile_order(const uint8_t* a, size_t ld_bytes, int m, size_t row_bytes,
                                 int step, int tile_step) {
  if (tile_step == step) return a;
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

// Software prefetch into L2 of the next n-block pair's weights, spread evenly over the steps of
// the current pair, so the DRAM stream runs under the tile work instead of stalling its first
// pass (the hardware streamer alone runs only a little ahead of the loads).
struct Prefetch {
  const uint8_t* p = nullptr;
  const uint8_t* end = nullptr;
  size_t lines_per_step = 0;
  Prefetch(const uint8_t* begin, const uint8_t* stop, size_t steps)
      : p(begin), end(stop), lines_per_step((size_t(stop - begin) / 64 + steps - 1) / steps) {}
  void step() {
    for (size_t i = 0; i < lines_per_step && p < end; ++i, p += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  }
};

// The tile product of a 2 x 2 loop: tdpbf16ps (bf16 pairs into fp32) or tdpbusd (u8 x s8
// quads into int32).
enum class TileOp { kBf16, kU8S8 };

// C tile I += A tile 4 + I / 2 x B tile 6 + I % 2 by Op. The instructions take tile numbers as
// immediates (spelled into their asm text), hence one literal call per tile and no runtime choice.
template <TileOp Op, int I>
__attribute__((always_inline)) inline void tile_dp() {
  static_assert(I >= 0 && I < 4, "C tiles are 0-3");
  if constexpr (Op == TileOp::kBf16) {
    if constexpr (I == 0) _tile_dpbf16ps(0, 4, 6);
    else if constexpr (I == 1) _tile_dpbf16ps(1, 4, 7);
    else if constexpr (I == 2) _tile_dpbf16ps(2, 5, 6);
    else _tile_dpbf16ps(3, 5, 7);
  } else {
    if constexpr (I == 0) _tile_dpbusd(0, 4, 6);
    else if constexpr (I == 1) _tile_dpbusd(1, 4, 7);
    else if constexpr (I == 2) _tile_dpbusd(2, 5, 6);
    else _tile_dpbusd(3, 5, 7);
  }
}

// The NT x NN C tiles to cb (tile 2 i + j at 1 KB * (2 i + j), rows 64 bytes; fp32 or int32).
template <int NT, int NN>
__attribute__((always_inline)) inline void store_c_tiles(void* cb) {
  uint8_t* p = static_cast<uint8_t*>(cb);
  _tile_stored(0, p, 64);
  if (NN > 1) _tile_stored(1, p + 1024, 64);
  if (NT > 1) _tile_stored(2, p + 2048, 64);
  if (NT > 1 && NN > 1) _tile_stored(3, p + 3072, 64);
}

// Op of token tiles (t, t + 1) x n-blocks (nb, nb + 1) into C tiles 0-3 (2 x 2: one tile load
// per product) over `steps` k-steps (each A and B tile 1 KB, 64 bytes a row): started from zero
// (`first`) or from cb as store_c_tiles leaves it; the caller stores the C tiles. a: the first
// token tile's A at the first k, a_next bytes to the second's; b0/b1: the n-blocks' B tiles at
// that k. pf steps once per k-step (a Prefetch, or any type with step(): work for the vector
// units beside the tile unit's). Shared by the bf16 and the int8 kernels.
template <TileOp Op, int NT, int NN, class Step>
__attribute__((always_inline)) inline void tile_products(const uint8_t* a, size_t a_next,
                                                         const uint8_t* b0, const uint8_t* b1,
                                                         int steps, bool first, const void* cb,
                                                         Step& pf) {
  if (first) {
    _tile_zero(0);
    if (NN > 1) _tile_zero(1);
    if (NT > 1) _tile_zero(2);
    if (NT > 1 && NN > 1) _tile_zero(3);
  } else {
    const uint8_t* p = static_cast<const uint8_t*>(cb);
    _tile_loadd(0, p, 64);
    if (NN > 1) _tile_loadd(1, p + 1024, 64);
    if (NT > 1) _tile_loadd(2, p + 2048, 64);
    if (NT > 1 && NN > 1) _tile_loadd(3, p + 3072, 64);
  }
  for (int s = 0; s < steps; ++s) {
    pf.step();
    const size_t off = size_t(s) * 1024;
    _tile_loadd(4, a + off, 64);
    _tile_loadd(6, b0 + off, 64);
    tile_dp<Op, 0>();
    if (NN > 1) {
      _tile_loadd(7, b1 + off, 64);
      tile_dp<Op, 1>();
    }
    if (NT > 1) {
      _tile_loadd(5, a + a_next + off, 64);
      tile_dp<Op, 2>();
      if (NN > 1) tile_dp<Op, 3>();
    }
  }
}

// tile_products with tdpbf16ps over k-steps of 32 k: from zero (`first`) or from `cb` (tile
// 2 * i + j at cb + 256 * (2 * i + j) floats, rows 64 bytes), ended in `c` (`last`, rows ldc
// floats apart) or `cb`.
template <int NT, int NN, class Step>
void bf16_tiles(const uint8_t* a, size_t a_next, const uint8_t* b0, const uint8_t* b1, int steps,
                bool first, bool last, float* cb, float* c, size_t ldc, Step& pf) {
  tile_products<TileOp::kBf16, NT, NN>(a, a_next, b0, b1, steps, first, cb, pf);
  if (last) {
    const size_t ldcb = ldc * 4;
    _tile_stored(0, c, ldcb);
    if (NN > 1) _tile_stored(1, c + 16, ldcb);
    if (NT > 1) _tile_stored(2, c + 16 * ldc, ldcb);
    if (NT > 1 && NN > 1) _tile_stored(3, c + 16 * ldc + 16, ldcb);
  } else {
    store_c_tiles<NT, NN>(cb);
  }
}

// Whether c (rows ldc floats apart) can take 64-byte non-temporal row stores.
inline bool streamable(const float* c, size_t ldc) {
  return (reinterpret_cast<uintptr_t>(c) & 63) == 0 && ldc % 16 == 0;
}

// Rows [0, mp) of acc (32 floats each: an n-block pair) into c (rows ldc floats apart), the
// pair's second half only when `two_n`; non-temporal with `stream` (c streamable; the caller
// fences once after its last pair: sfence_if).
inline void store_pair(const float* acc, int mp, bool two_n, float* c, size_t ldc, bool stream) {
  if (stream) {
    for (int r = 0; r < mp; ++r) {
      float* dst = c + size_t(r) * ldc;
      _mm512_stream_ps(dst, _mm512_load_ps(acc + size_t(r) * 32));
      if (two_n) _mm512_stream_ps(dst + 16, _mm512_load_ps(acc + size_t(r) * 32 + 16));
    }
    return;
  }
  for (int r = 0; r < mp; ++r)
    std::memcpy(c + size_t(r) * ldc, acc + size_t(r) * 32, sizeof(float) * 16 * (two_n ? 2 : 1));
}

// C tiles stored at cb as bf16_tiles leaves them (nt x nn tiles) into c (rows ldc floats apart,
// 64-byte aligned) with non-temporal stores.
inline void stream_tiles(const float* cb, int nt, int nn, float* c, size_t ldc) {
  for (int i = 0; i < nt; ++i)
    for (int r = 0; r < 16; ++r)
      for (int j = 0; j < nn; ++j)
        _mm512_stream_ps(c + size_t(16 * i + r) * ldc + 16 * j,
                         _mm512_load_ps(cb + 256 * (2 * i + j) + 16 * r));
}

// Orders store_pair's and stream_tiles' non-temporal stores before whatever tells another
// thread the data is there.
inline void sfence_if(bool stream) {
  if (stream) _mm_sfence();
}

// k-steps (32 k each) per K chunk when a pair of n-blocks meets more than one token-tile pair: the
// chunk's B tiles (2 x 8 KB) stay in L1 while every token pair passes over them, so only A comes
// from L2 (a 2x2 step needs 4 KB per 4 tdpbf16ps; from L2 alone that is the bound).
constexpr int kChunkSteps = 8;

// One n-block pair (b0, and b1 when two_n: bf16 B tiles, kbs 32-k blocks) over the call's m
// rows, K chunk outer, token-tile pairs inner (B reused from L1); x: A in tile order, token tiles
// tile_stride bytes apart. C goes to c (rows ldc floats apart), or with `stream` through cbuf
// (4 KB per token pair) into non-temporal row stores. pf steps once per k-step of each token
// pair: kbs * ceil(m / 32) steps in all.
// Inlined into its callers (bf16 and int4), as gemm_bf16's loop was before int4 shared it.
template <class Step>
__attribute__((always_inline)) inline void bf16_pair(const uint8_t* x, size_t tile_stride, int m,
                                                     const uint8_t* b0, const uint8_t* b1,
                                                     bool two_n, int kbs, Step& pf,
                                                     float* cbuf, float* c, size_t ldc,
                                                     bool stream) {
  const int chunk = m > 32 ? kChunkSteps : kbs;
  for (int k0 = 0; k0 < kbs; k0 += chunk) {
    const int steps = std::min(chunk, kbs - k0);
    const bool first = k0 == 0, last = k0 + steps == kbs, to_c = last && !stream;
    const size_t koff = size_t(k0) * 1024;
    for (int t = 0; t < m; t += 32) {
      const uint8_t* at = x + size_t(t / 16) * tile_stride + koff;
      float* cb = cbuf + size_t(t / 32) * 1024;
      float* ct = c + size_t(t) * ldc;
      const bool two_t = t + 16 < m;
      if (two_t && two_n)
        bf16_tiles<2, 2>(at, tile_stride, b0 + koff, b1 + koff, steps, first, to_c, cb, ct, ldc,
                         pf);
      else if (two_t)
        bf16_tiles<2, 1>(at, tile_stride, b0 + koff, b1 + koff, steps, first, to_c, cb, ct, ldc,
                         pf);
      else if (two_n)
        bf16_tiles<1, 2>(at, tile_stride, b0 + koff, b1 + koff, steps, first, to_c, cb, ct, ldc,
                         pf);
      else
        bf16_tiles<1, 1>(at, tile_stride, b0 + koff, b1 + koff, steps, first, to_c, cb, ct, ldc,
                         pf);
      if (last && stream) stream_tiles(cb, two_t ? 2 : 1, two_n ? 2 : 1, ct, ldc);
    }
  }
}

// The next pair of n-blocks after [nb, nb + 2) within [.., nb_end) as one byte range.
inline Prefetch next_pair(const PackedMatrix& w, int nb, int nb_end, size_t steps) {
  const int first = std::min(nb + 2, nb_end), last = std::min(nb + 4, nb_end);
  return Prefetch(w.n_block(first), w.n_block(last), steps);
}

}  // namespace
}  // namespace hetmoe
