// Activations of the rows of one MoE call in the kernels' input form (bf16, or u8 with per-group
// scale / bias / sum arrays), as a call's phases write and read them (call_plan.h).
// Rows are row-major, or, for experts on AMX tiles, in tile order per 16-row block (the block
// keeps its place and size; within it [k bytes / step][16 rows][step bytes], ActView::tile_step),
// so the AMX kernels read A tiles in place. Tiled rows must start 16-row blocks of their own
// (experts start 16-aligned), and every row of a block is in the same layout.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/gemm.h"

namespace hetmoe {

// Activations of `rows` rows x `k` columns stored at `act` with group arrays [3][total][k / gs].
struct ActStore {
  uint8_t* act = nullptr;
  float* groups = nullptr;
  size_t k = 0, total = 0, ngroups = 0, elem = 0;

  // Bytes per tile row of the tile order the AMX kernels read: 32 bf16, or one k-step of u8
  // (min(64, group size)).
  int tile_step() const { return elem == 2 ? 64 : int(std::min<size_t>(64, k / ngroups)); }

  ActView view(long row0, int m, bool tiled = false) const {
    ActView v;
    v.m = m;
    v.ld = k;
    if (elem == 2) v.bf16 = reinterpret_cast<const uint16_t*>(act) + row0 * k;
    else v.u8 = act + row0 * k;
    if (ngroups) {
      v.scale = groups + row0 * ngroups;
      v.bias = groups + (total + row0) * ngroups;
      v.sum = groups + (2 * total + row0) * ngroups;
      v.ldg = ngroups;
    }
    v.tile_step = tiled ? tile_step() : 0;
    return v;
  }
  // Converts fp32 values into row `row`, columns [col, col + n) (n: whole groups; tiled: col and
  // n whole tile rows).
  void put(const Epilogue& ep, long row, size_t col, const float* x, int n, int group_size,
           bool tiled = false) const {
    uint8_t* out = tiled ? staging(n * elem) : act + (row * k + col) * elem;
    if (elem == 2) {
      ep.to_bf16(x, n, reinterpret_cast<uint16_t*>(out));
    } else {
      const size_t g = row * ngroups + col / group_size;
      ep.to_u8(x, n, group_size, out, groups + g, groups + total * ngroups + g,
               groups + 2 * total * ngroups + g);
    }
    if (tiled) scatter(row, col * elem, out, n * elem);
  }
  void zero(long row, size_t col, size_t n, int group_size, bool tiled = false) const {
    if (tiled) {
      const int step = tile_step();
      for (size_t b = 0; b < n * elem; b += step) std::memset(at(row, col * elem + b), 0, step);
    } else {
      std::memset(act + (row * k + col) * elem, 0, n * elem);
    }
    if (!ngroups) return;
    for (int a = 0; a < 3; ++a)
      std::memset(groups + (a * total + row) * ngroups + col / group_size, 0,
                  sizeof(float) * (n / group_size));
  }
  // Row `from` of the row-major `src` into row `to`.
  void copy_row(const ActStore& src, long from, long to) const {
    std::memcpy(act + to * k * elem, src.act + from * k * elem, k * elem);
    copy_groups(src, from, to);
  }
  // The 16-row block from row `row0` (16-aligned) in tile order: row r is row tokens[r] of the
  // row-major `src`, or zero where tokens[r] < 0. Written in address order (one tile row of each
  // of the 16 rows in turn), so the block's lines are filled one after another.
  void gather_tiled_block(const ActStore& src, const int* tokens, long row0) const {
    const size_t step = size_t(tile_step()), row_bytes = k * elem;
    uint8_t* dst = act + size_t(row0) * row_bytes;
    const uint8_t* in[16];
    for (int r = 0; r < 16; ++r) in[r] = tokens[r] < 0 ? nullptr : src.act + tokens[r] * row_bytes;
    for (size_t b = 0; b < row_bytes; b += step)
      for (int r = 0; r < 16; ++r, dst += step) {
        if (step == 64) {
          if (in[r]) std::memcpy(dst, in[r] + b, 64);
          else std::memset(dst, 0, 64);
        } else {
          if (in[r]) std::memcpy(dst, in[r] + b, step);
          else std::memset(dst, 0, step);
        }
      }
    for (int r = 0; r < 16 && ngroups; ++r) {
      if (tokens[r] < 0) {
        for (int a = 0; a < 3; ++a)
          std::memset(groups + (a * total + row0 + r) * ngroups, 0, sizeof(float) * ngroups);
      } else {
        copy_groups(src, tokens[r], row0 + r);
      }
    }
  }

 private:
  // Byte `b` of row `row` in tile order.
  uint8_t* at(long row, size_t b) const {
    const size_t step = size_t(tile_step());
    return act + size_t(row & ~15L) * k * elem + (b / step) * 16 * step + size_t(row & 15) * step +
           b % step;
  }
  // bytes (whole tile rows) of one row from `src`, starting at byte b0 of the row, in tile order.
  void scatter(long row, size_t b0, const uint8_t* src, size_t bytes) const {
    const size_t step = size_t(tile_step());
    uint8_t* dst = at(row, b0);
    if (step == 64) {
      for (size_t b = 0; b < bytes; b += 64, dst += 16 * 64) std::memcpy(dst, src + b, 64);
    } else {
      for (size_t b = 0; b < bytes; b += step, dst += 16 * step) std::memcpy(dst, src + b, step);
    }
  }
  void copy_groups(const ActStore& src, long from, long to) const {
    for (int a = 0; a < 3 && ngroups; ++a)
      std::memcpy(groups + (a * total + to) * ngroups,
                  src.groups + (a * src.total + from) * ngroups, sizeof(float) * ngroups);
  }
  static uint8_t* staging(size_t bytes) {
    thread_local std::vector<uint8_t> buf;
    if (buf.size() < bytes) buf.resize(bytes);
    return buf.data();
  }
};

}  // namespace hetmoe
