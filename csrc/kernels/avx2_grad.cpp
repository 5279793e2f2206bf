// AVX2 backward kernels: fp32 dot in four 8-lane FMA accumulators; the unpack and axpy loops
// vectorized by the compiler for AVX2.
#include <immintrin.h>

#include "kernels/epilogue.h"
#include "kernels/grad.h"
#include "kernels/unpack_rows.h"

namespace hetmoe {
namespace {

float dot_avx2(const float* a, const float* b, int n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  int i = 0;
  for (; i + 32 <= n; i += 32)
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * u), _mm256_loadu_ps(b + i + 8 * u),
                               acc[u]);
  for (; i + 8 <= n; i += 8)
    acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc[0]);
  const __m256 s8 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  float s = _mm_cvtss_f32(s4);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

const GradKernels& avx2_grad_kernels() {
  static const GradKernels k{"avx2", unpack_rows, dot_avx2, axpy_row};
  return k;
}

}  // namespace hetmoe
