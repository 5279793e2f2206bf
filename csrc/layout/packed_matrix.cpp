// Packing and group-wise quantization of one projection into the block layout (packed_matrix.h).
#include "layout/packed_matrix.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "layout/bf16.h"

namespace hetmoe {
namespace {

// Reads one source row as floats, zero beyond the valid columns.
void read_row(const void* src, SourceType type, size_t ld, long row, long valid_cols, int k,
              float* out) {
  std::fill(out, out + k, 0.0f);
  if (type == SourceType::kBF16) {
    const uint16_t* p = static_cast<const uint16_t*>(src) + size_t(row) * ld;
    for (long c = 0; c < valid_cols; ++c) out[c] = bf16_to_float(p[c]);
  } else {
    const float* p = static_cast<const float*>(src) + size_t(row) * ld;
    std::memcpy(out, p, sizeof(float) * valid_cols);
  }
}

struct GroupQuant {
  float scale = 0, bias = 0;
};

GroupQuant quantize_int8(const float* w, int g, int8_t* q) {
  float amax = 0;
  for (int i = 0; i < g; ++i) amax = std::max(amax, std::fabs(w[i]));
  GroupQuant r;
  r.scale = amax / 127.0f;
  const float inv = amax > 0 ? 127.0f / amax : 0.0f;
  for (int i = 0; i < g; ++i) q[i] = int8_t(std::nearbyint(w[i] * inv));
  return r;
}

// Asymmetric 16-level groups: start from min/max, then alternate rounding with a least-squares
// refit of (scale, offset), keeping the best; ~8% less layer error than plain min/max.
GroupQuant quantize_int4(const float* w, int g, int8_t* q) {
  float lo = w[0], hi = w[0], mean = 0;
  for (int i = 0; i < g; ++i) lo = std::min(lo, w[i]), hi = std::max(hi, w[i]), mean += w[i];
  mean /= float(g);
  GroupQuant best;
  if (hi == lo) {
    for (int i = 0; i < g; ++i) q[i] = 0;
    best.bias = lo;
    return best;
  }
  float base = lo, scale = (hi - lo) / 15.0f, best_err = INFINITY;
  int8_t cand[256];
  for (int iter = 0; iter < 5; ++iter) {
    const float inv = 1.0f / scale;
    float err = 0, qmean = 0;
    for (int i = 0; i < g; ++i) {
      const float v = std::clamp(std::nearbyint((w[i] - base) * inv), 0.0f, 15.0f);
      cand[i] = int8_t(v);
      const float d = base + scale * v - w[i];
      err += d * d;
      qmean += v;
    }
    if (err < best_err) {
      best_err = err;
      best.scale = scale;
      best.bias = base + 8 * scale;
      for (int i = 0; i < g; ++i) q[i] = int8_t(cand[i] - 8);
    }
    qmean /= float(g);
    float cov = 0, var = 0;
    for (int i = 0; i < g; ++i) {
      const float dq = float(cand[i]) - qmean;
      cov += dq * (w[i] - mean);
      var += dq * dq;
    }
    if (var <= 0 || cov <= 0) break;
    scale = cov / var;
    base = mean - scale * qmean;
  }
  return best;
}

void pack_block_bf16(const std::vector<float>& rows, int k, uint8_t* dst) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (int kb = 0; kb < k / 32; ++kb, out += 512)
    for (int n = 0; n < kBlockN; ++n)
      for (int kk = 0; kk < 32; ++kk)
        out[(kk / 2) * 32 + n * 2 + kk % 2] = float_to_bf16(rows[size_t(n) * k + kb * 32 + kk]);
}

// q: [16][k] signed values of n-block nb; int8 blocks hold them as bytes, int4 blocks as nibbles
// of (q + 8).
void place_int(const PackedMatrix& m, int nb, const std::vector<int8_t>& q) {
  const int k = m.k;
  const bool int4 = m.int4();
  for (int kb = 0; kb < k / 64; ++kb) {
    uint8_t* blk = m.k_block(nb, kb);
    std::memset(blk, 0, m.block_bytes());
    for (int n = 0; n < kBlockN; ++n)
      for (int kk = 0; kk < 64; ++kk) {
        const int r = kk / 4, pos = n * 4 + kk % 4;
        const int8_t v = q[size_t(n) * k + kb * 64 + kk];
        if (!int4) {
          blk[r * 64 + pos] = uint8_t(v);
        } else {
          const uint8_t nib = uint8_t(v + 8) & 0xF;
          blk[(r % 8) * 64 + pos] |= r < 8 ? nib : uint8_t(nib << 4);
        }
      }
  }
}

}  // namespace

namespace {

size_t scales_offset(const PackedMatrix& m) { return round_up(m.blocks_bytes(), 64); }
size_t scale_bytes(const PackedMatrix& m) { return round_up(m.group_floats() * sizeof(float), 64); }

}  // namespace

size_t packed_memory_bytes(const PackedMatrix& m) {
  return scales_offset(m) + m.scale_arrays() * scale_bytes(m);
}

void place_packed(PackedMatrix& m, uint8_t* memory) {
  m.blocks = memory;
  m.scale = m.scale_qsum = nullptr;
  if (m.scale_arrays() > 0) m.scale = reinterpret_cast<float*>(m.blocks + scales_offset(m));
  if (m.scale_arrays() > 1)
    m.scale_qsum = reinterpret_cast<float*>(m.blocks + scales_offset(m) + scale_bytes(m));
}

void pack_rows(PackedMatrix& m, int nb_begin, int num_blocks, const void* src, SourceType type,
               size_t ld, long valid_rows, long valid_cols) {
  const int k = m.k, groups = m.num_groups(), gs = m.group_size;
  const bool int4 = m.format == WeightFormat::kINT4;
  std::vector<float> rows(size_t(kBlockN) * k);
  std::vector<int8_t> q(m.format == WeightFormat::kBF16 ? 0 : size_t(kBlockN) * k);
  for (int b = 0; b < num_blocks; ++b) {
    const int nb = nb_begin + b;
    for (int n = 0; n < kBlockN; ++n) {
      const long row = long(b) * kBlockN + n;
      if (row < valid_rows) {
        read_row(src, type, ld, row, std::min<long>(valid_cols, k), k, &rows[size_t(n) * k]);
      } else {
        std::fill(&rows[size_t(n) * k], &rows[size_t(n) * k] + k, 0.0f);
      }
    }
    if (m.format == WeightFormat::kBF16) {
      pack_block_bf16(rows, k, m.n_block(nb));
      continue;
    }
    for (int n = 0; n < kBlockN; ++n) {
      for (int g = 0; g < groups; ++g) {
        const float* w = &rows[size_t(n) * k + size_t(g) * gs];
        int8_t* qg = &q[size_t(n) * k + size_t(g) * gs];
        const GroupQuant r = int4 ? quantize_int4(w, gs, qg) : quantize_int8(w, gs, qg);
        int qsum = 0;
        for (int i = 0; i < gs; ++i) qsum += qg[i];
        if (int4) {
          // The kernels see the bf16-rounded scale: its zero-point term uses the same value.
          uint16_t* meta = m.meta(nb, g);
          meta[n] = float_to_bf16(r.scale);
          meta[16 + n] = float_to_bf16(bf16_to_float(meta[n]) * float(qsum));
          meta[32 + n] = float_to_bf16(r.bias);
        } else {
          const size_t at = (size_t(nb) * groups + g) * kBlockN + n;
          m.scale[at] = r.scale;
          m.scale_qsum[at] = r.scale * float(qsum);
        }
      }
    }
    place_int(m, nb, q);
  }
}

// fp8_pack.cpp: the FP8 branch of pack_source.
void pack_fp8_rows(PackedMatrix& m, int nb_begin, int num_blocks, const SourceMatrix& src,
                   long row0, long col0);

void pack_source(PackedMatrix& m, int nb_begin, int num_blocks, const SourceMatrix& src,
                 long row0, long col0) {
  if ((src.type == SourceType::kFP8) != m.fp8())
    throw std::invalid_argument("pack_source: FP8 sources pack into the fp8 format only, and the "
                                "fp8 format takes FP8 sources only");
  if (m.fp8()) return pack_fp8_rows(m, nb_begin, num_blocks, src, row0, col0);
  const size_t elem = src.type == SourceType::kBF16 ? 2 : 4;
  const uint8_t* first = static_cast<const uint8_t*>(src.data) +
                         (size_t(row0) * size_t(src.cols) + size_t(col0)) * elem;
  pack_rows(m, nb_begin, num_blocks, first, src.type, size_t(src.cols), src.rows - row0,
            src.cols - col0);
}

}  // namespace hetmoe
