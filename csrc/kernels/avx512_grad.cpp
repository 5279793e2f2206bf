// AVX-512 backward kernels: fp32 dot in four 16-lane FMA accumulators (masked tail); bf16
// n-blocks unpacked a 64-byte block row at a time; the int unpack and axpy loops vectorized by
// the compiler for AVX-512.
#include <immintrin.h>

#include "kernels/epilogue.h"
#include "kernels/grad.h"
#include "kernels/unpack_rows.h"

namespace hetmoe {
namespace {

float dot_avx512(const float* a, const float* b, int n) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int i = 0;
  for (; i + 64 <= n; i += 64)
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16 * u),
                               _mm512_loadu_ps(b + i + 16 * u), acc[u]);
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    acc[0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i),
                             acc[0]);
  }
  return _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

// A block row (16 n x 2 k bf16) widened to fp32: the even-k words shifted up, the odd-k words
// masked, each pair stored at its row's k.
void unpack_avx512(const PackedMatrix& w, int nb, float* out, size_t ld) {
  if (w.format != WeightFormat::kBF16) return unpack_rows(w, nb, out, ld);
  const __m512i hi_mask = _mm512_set1_epi32(int(0xFFFF0000u));
  alignas(64) float even[16], odd[16];
  for (int kb = 0; kb < w.num_k_blocks(); ++kb) {
    const uint8_t* blk = w.k_block(nb, kb);
    for (int r = 0; r < 16; ++r) {
      const __m512i v = _mm512_loadu_si512(blk + r * 64);
      _mm512_store_ps(even, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
      _mm512_store_ps(odd, _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask)));
      for (int n = 0; n < kBlockN; ++n) {
        float* o = out + size_t(n) * ld + kb * 32 + 2 * r;
        o[0] = even[n];
        o[1] = odd[n];
      }
    }
  }
}

}  // namespace

const GradKernels& avx512_grad_kernels() {
  static const GradKernels k{"avx512", unpack_avx512, dot_avx512, axpy_row};
  return k;
}

}  // namespace hetmoe
