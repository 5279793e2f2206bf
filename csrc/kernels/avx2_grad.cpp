// AVX2 backward kernels: a 6-row x 16-column fp32 FMA register tile (12 accumulators) walked
// over each 16 columns of the panel; the panels unpacked by the scalar loops of grad_unpack.h,
// vectorized by the compiler for AVX2.
#include <immintrin.h>

#include "kernels/grad_silu.h"
#include "kernels/grad.h"
#include "kernels/grad_unpack.h"

namespace hetmoe {
namespace {

constexpr int kTileRows = 6;

// c[MR rows][16] (+)= a[MR rows][depth] . b[depth][16 of cols]
template <int MR>
void tile(int depth, const float* a, size_t lda, const float* b, int cols, float* c, size_t ldc,
          bool accumulate) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 2; ++v)
      acc[i][v] = accumulate ? _mm256_loadu_ps(c + size_t(i) * ldc + 8 * v) : _mm256_setzero_ps();
  for (int r = 0; r < depth; ++r) {
    const __m256 b0 = _mm256_loadu_ps(b + size_t(r) * cols);
    const __m256 b1 = _mm256_loadu_ps(b + size_t(r) * cols + 8);
    for (int i = 0; i < MR; ++i) {
      const __m256 ai = _mm256_broadcast_ss(a + size_t(i) * lda + r);
      acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(c + size_t(i) * ldc + 8 * v, acc[i][v]);
}

void gemm_avx2(int m, int depth, const float* a, size_t lda, const float* b, int cols, float* c,
               size_t ldc, bool accumulate) {
  for (int j = 0; j < cols; j += 16)
    for (int i = 0; i < m; i += kTileRows) {
      const float* ai = a + size_t(i) * lda;
      float* ci = c + size_t(i) * ldc + j;
      switch (m - i >= kTileRows ? kTileRows : m - i) {
        case 1: tile<1>(depth, ai, lda, b + j, cols, ci, ldc, accumulate); break;
        case 2: tile<2>(depth, ai, lda, b + j, cols, ci, ldc, accumulate); break;
        case 3: tile<3>(depth, ai, lda, b + j, cols, ci, ldc, accumulate); break;
        case 4: tile<4>(depth, ai, lda, b + j, cols, ci, ldc, accumulate); break;
        case 5: tile<5>(depth, ai, lda, b + j, cols, ci, ldc, accumulate); break;
        default: tile<6>(depth, ai, lda, b + j, cols, ci, ldc, accumulate); break;
      }
    }
}

}  // namespace

const GradKernels& avx2_grad_kernels() {
  static const GradKernels k{"avx2", unpack_cols_scalar, unpack_rows_scalar, gemm_avx2,
                             silu_sig_row, nullptr};
  return k;
}

}  // namespace hetmoe
