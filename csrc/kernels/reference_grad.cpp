// Scalar backward kernels: plain loops, the path for CPUs without AVX2 and the baseline the
// ISA files are tested beside (each against the same float64 oracle).
#include "kernels/grad_silu.h"
#include "kernels/grad.h"
#include "kernels/grad_unpack.h"

namespace hetmoe {
namespace {

void gemm_scalar(int m, int depth, const float* a, size_t lda, const float* b, int cols,
                 float* c, size_t ldc, bool accumulate) {
  for (int i = 0; i < m; ++i) {
    float* ci = c + size_t(i) * ldc;
    if (!accumulate)
      for (int j = 0; j < cols; ++j) ci[j] = 0.0f;
    for (int r = 0; r < depth; ++r) {
      const float ar = a[size_t(i) * lda + r];
      for (int j = 0; j < cols; ++j) ci[j] += ar * b[size_t(r) * cols + j];
    }
  }
}

}  // namespace

const GradKernels& reference_grad_kernels() {
  static const GradKernels k{"scalar", unpack_cols_scalar, unpack_rows_scalar, gemm_scalar,
                             silu_sig_row, nullptr};
  return k;
}

}  // namespace hetmoe
