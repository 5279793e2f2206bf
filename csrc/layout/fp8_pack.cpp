// FP8 experts packed as the checkpoint stores them: the e4m3 codes copied into the fp8 block
// order (packed_matrix.h) and each row's block scale repeated per (row, group), so nothing is
// requantized: a group lies inside one scale block (the group divides block_k), and a per-row
// scale is the block's scale for every row of the block (the n granularity refined exactly).
#include <cstring>
#include <stdexcept>
#include <string>

#include "layout/packed_matrix.h"

namespace hetmoe {
namespace {

// The scale of source row `row` for columns from `col` (0 past the source's rows or columns:
// padding weights are zero codes anyway).
float block_scale(const SourceMatrix& s, long row, long col) {
  if (row >= s.rows || col >= s.cols) return 0.0f;
  const BlockScales& b = s.scales;
  return b.data[size_t(row / b.block_n) * b.ld + size_t(col / b.block_k)];
}

void check_fp8(const PackedMatrix& m, const SourceMatrix& s, long col0) {
  const BlockScales& b = s.scales;
  const bool scales_ok = b.data && b.block_n >= 1 && b.block_k >= 1 &&
                         b.ld >= size_t((s.cols + b.block_k - 1) / b.block_k);
  if (!scales_ok)
    throw std::invalid_argument("pack_source: FP8 source needs block scales (block_n, block_k >= "
                                "1, ld >= its scale columns)");
  if (b.block_k % m.group_size != 0 || col0 % m.group_size != 0)
    throw std::invalid_argument("pack_source: fp8 group " + std::to_string(m.group_size) +
                                " must divide the scale block (" + std::to_string(b.block_k) +
                                " columns) and the first column (" + std::to_string(col0) + ")");
}

}  // namespace

void pack_fp8_rows(PackedMatrix& m, int nb_begin, int num_blocks, const SourceMatrix& src,
                   long row0, long col0) {
  check_fp8(m, src, col0);
  const uint8_t* codes = static_cast<const uint8_t*>(src.data);
  const long cols = src.cols - col0 < m.k ? src.cols - col0 : m.k;  // valid columns read
  const int groups = m.num_groups(), gs = m.group_size;
  for (int b = 0; b < num_blocks; ++b) {
    const int nb = nb_begin + b;
    uint8_t* blk = m.n_block(nb);  // [K/2][16][2]
    std::memset(blk, 0, m.n_block_bytes());
    for (int n = 0; n < kBlockN; ++n) {
      const long row = row0 + long(b) * kBlockN + n;
      if (row < src.rows && cols > 0) {
        const uint8_t* in = codes + size_t(row) * src.cols + col0;
        for (long c = 0; c < cols; ++c) blk[(c / 2) * 32 + n * 2 + c % 2] = in[c];
      }
      for (int g = 0; g < groups; ++g)
        m.scale[(size_t(nb) * groups + g) * kBlockN + n] =
            block_scale(src, row, col0 + long(g) * gs);
    }
  }
}

}  // namespace hetmoe
