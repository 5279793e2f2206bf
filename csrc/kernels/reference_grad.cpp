// Scalar backward kernels: plain loops, the path for CPUs without AVX2 and the baseline the
// ISA files are tested beside (each against the same float64 oracle).
#include "kernels/epilogue.h"
#include "kernels/grad.h"
#include "kernels/unpack_rows.h"

namespace hetmoe {
namespace {

float dot_scalar(const float* a, const float* b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

const GradKernels& reference_grad_kernels() {
  static const GradKernels k{"scalar", unpack_rows, dot_scalar, axpy_row};
  return k;
}

}  // namespace hetmoe
