// Scalar reference kernels: plain loops over the packed layout, the oracle for the ISA kernels
// and the path for CPUs with no AVX2.
#include <cmath>
#include <vector>

#include "kernels/epilogue.h"
#include "kernels/gemm.h"
#include "layout/bf16.h"
#include "layout/fp8.h"

namespace hetmoe {
namespace {

void gemm_bf16(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
               size_t ldc) {
  const int kblocks = w.num_k_blocks();
  for (int nb = nb_begin; nb < nb_end; ++nb) {
    const uint16_t* blk = reinterpret_cast<const uint16_t*>(w.n_block(nb));
    for (int t = 0; t < a.m; ++t) {
      float acc[kBlockN] = {};
      const uint16_t* x = a.bf16 + size_t(t) * a.ld;
      for (int kb = 0; kb < kblocks; ++kb)
        for (int r = 0; r < 16; ++r)
          for (int n = 0; n < kBlockN; ++n)
            for (int j = 0; j < 2; ++j)
              acc[n] += bf16_to_float(blk[kb * 512 + r * 32 + n * 2 + j]) *
                        bf16_to_float(x[kb * 32 + r * 2 + j]);
      for (int n = 0; n < kBlockN; ++n) c[size_t(t) * ldc + (nb - nb_begin) * 16 + n] = acc[n];
    }
  }
}

// Signed weight of row r (0..15 of a 64-k block), byte `pos` (n * 4 + k % 4).
inline int weight_at(const uint8_t* blk, bool int4, int r, int pos) {
  if (!int4) return int8_t(blk[r * 64 + pos]);
  const uint8_t byte = blk[(r % 8) * 64 + pos];
  return int((r < 8 ? byte : byte >> 4) & 0xF) - 8;
}

template <bool kInt4>
void gemm_int(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
              size_t ldc) {
  const int groups = w.num_groups(), gs = w.group_size;
  for (int nb = nb_begin; nb < nb_end; ++nb) {
    for (int t = 0; t < a.m; ++t) {
      const uint8_t* x = a.u8 + size_t(t) * a.ld;
      float acc[kBlockN] = {};
      for (int g = 0; g < groups; ++g) {
        int32_t dot[kBlockN] = {};
        for (int kk = g * gs; kk < (g + 1) * gs; ++kk) {
          const uint8_t* blk = w.k_block(nb, kk / 64);
          const int r = (kk % 64) / 4;
          for (int n = 0; n < kBlockN; ++n)
            dot[n] += int(x[kk]) * weight_at(blk, kInt4, r, n * 4 + kk % 4);
        }
        const size_t at = (size_t(nb) * groups + g) * kBlockN;
        const float sx = a.scale[size_t(t) * a.ldg + g], bx = a.bias[size_t(t) * a.ldg + g];
        const uint16_t* meta = kInt4 ? w.meta(nb, g) : nullptr;
        for (int n = 0; n < kBlockN; ++n) {
          const float sw = kInt4 ? bf16_to_float(meta[n]) : w.scale[at + n];
          const float swq = kInt4 ? bf16_to_float(meta[16 + n]) : w.scale_qsum[at + n];
          // Fused, in the ISA kernels' order, so that every ISA computes the same floats (hidden
          // activations are requantized: one ulp there can move a u8 step).
          acc[n] = std::fma(float(dot[n]), sw * sx, acc[n]);
          acc[n] = std::fma(swq, bx, acc[n]);
          if (kInt4) acc[n] = std::fma(bf16_to_float(meta[32 + n]), a.sum[size_t(t) * a.ldg + g],
                                       acc[n]);
        }
      }
      for (int n = 0; n < kBlockN; ++n) c[size_t(t) * ldc + (nb - nb_begin) * 16 + n] = acc[n];
    }
  }
}

}  // namespace

// Per group of k: the exact e4m3 values times bf16 x summed in fp32, then times the group's
// per-row scale (the ISA kernels' order; their sums run in other orders).
void reference_gemm_fp8(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end,
                        float* c, size_t ldc) {
  const int groups = w.num_groups(), gs = w.group_size;
  for (int nb = nb_begin; nb < nb_end; ++nb) {
    const uint8_t* codes = w.n_block(nb);  // [K/2][16][2]
    for (int t = 0; t < a.m; ++t) {
      const uint16_t* x = a.bf16 + size_t(t) * a.ld;
      float acc[kBlockN] = {};
      for (int g = 0; g < groups; ++g) {
        float dot[kBlockN] = {};
        for (int kk = g * gs; kk < (g + 1) * gs; ++kk)
          for (int n = 0; n < kBlockN; ++n)
            dot[n] += fp8_e4m3_to_float(codes[(kk / 2) * 32 + n * 2 + kk % 2]) *
                      bf16_to_float(x[kk]);
        const float* scale = w.scale + (size_t(nb) * groups + g) * kBlockN;
        for (int n = 0; n < kBlockN; ++n) acc[n] = std::fma(dot[n], scale[n], acc[n]);
      }
      for (int n = 0; n < kBlockN; ++n) c[size_t(t) * ldc + (nb - nb_begin) * 16 + n] = acc[n];
    }
  }
}

const IsaKernels& reference_kernels() {
  static const IsaKernels k{"scalar", gemm_bf16, gemm_int<false>, gemm_int<true>,
                            reference_gemm_fp8,
                            {silu_mul_row, to_bf16_row, to_u8_row, axpy_row}};
  return k;
}

}  // namespace hetmoe
