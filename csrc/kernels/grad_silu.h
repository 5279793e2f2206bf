// The backward's SiLU forward (kernels/grad.h GradKernels::silu) for the grad kernel file that
// includes it (internal linkage, compiled with that file's ISA flags): epilogue.h's exp, with the
// sigmoid kept so that the backward's SiLU derivative needs no second exp.
#pragma once

#include "kernels/epilogue.h"

namespace hetmoe {
namespace {

// c: [gate 16, up 16] column pairs; h, sig: cols values.
inline void silu_sig_row(const float* __restrict c, int cols, float* __restrict h,
                         float* __restrict sig) {
  for (int b = 0; b < cols / 16; ++b) {
#ifdef __AVX512F__
    const __m512 g = _mm512_loadu_ps(c + 2 * b * 16), u = _mm512_loadu_ps(c + (2 * b + 1) * 16);
    const __m512 e = fast_exp16(_mm512_xor_ps(g, _mm512_set1_ps(-0.0f)));  // exp(-g)
    const __m512 s = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(sig + b * 16, s);
    _mm512_storeu_ps(h + b * 16, _mm512_mul_ps(_mm512_mul_ps(g, s), u));
#else
    for (int l = 0; l < 16; ++l) {
      const float g = c[2 * b * 16 + l], u = c[(2 * b + 1) * 16 + l];
      const float s = 1.0f / (1.0f + fast_exp(-g));
      sig[b * 16 + l] = s;
      h[b * 16 + l] = g * s * u;
    }
#endif
  }
}

}  // namespace
}  // namespace hetmoe
