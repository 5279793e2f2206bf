// AVX-512 fp8 kernel for few tokens per expert (decode): each 64-byte line of an n-block (two
// rows of 16 n x 2 k codes) is widened to two bf16 registers in place (kernels/fp8_avx512.h) and
// multiplied with vdpbf16ps as the bf16 kernel does, one fp32 sum per group of k, which is then
// scaled by the group's 16 per-row scales. One byte per weight is read, like int8.
#include <immintrin.h>

#include "kernels/fp8_avx512.h"
#include "kernels/gemm.h"

namespace hetmoe {
namespace {

constexpr int kMaxTokens = 4;
// Every line of the n-block range is prefetched this far ahead, as the bf16 and int4 kernels do
// (avx512.cpp: one core streams ~10.6 GB/s so instead of ~7).
constexpr size_t kStreamAhead = 4096;

inline __m512bh broadcast_pair(const uint16_t* x) {
  return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x));
}

// c[t * ldc + n] for tokens t0 .. t0 + MT - 1 and n-block nb; `end`: the end of the caller's
// n-blocks (prefetches stop there).
template <int MT>
void fp8_tokens(const PackedMatrix& w, int nb, const ActView& a, int t0, float* c, size_t ldc,
                const uint8_t* end, __m512i subnormals) {
  const int groups = w.num_groups(), gs = w.group_size;
  const uint8_t* line = w.n_block(nb);  // [K/2][16][2] codes, 64 bytes = 4 k of 16 n
  const float* scale = w.scale + size_t(nb) * groups * kBlockN;
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g, scale += kBlockN) {
    __m512 even[MT], odd[MT];
    for (int t = 0; t < MT; ++t) even[t] = odd[t] = _mm512_setzero_ps();
    for (int k = g * gs; k < (g + 1) * gs; k += 4, line += 64) {
      if (line + kStreamAhead + 64 <= end)
        _mm_prefetch(reinterpret_cast<const char*>(line + kStreamAhead), _MM_HINT_T0);
      const __m512bh w0 = (__m512bh)fp8x32_to_bf16(line, subnormals);
      const __m512bh w1 = (__m512bh)fp8x32_to_bf16(line + 32, subnormals);
      for (int t = 0; t < MT; ++t) {
        const uint16_t* xt = a.bf16 + size_t(t0 + t) * a.ld + k;
        even[t] = _mm512_dpbf16_ps(even[t], broadcast_pair(xt), w0);
        odd[t] = _mm512_dpbf16_ps(odd[t], broadcast_pair(xt + 2), w1);
      }
    }
    const __m512 s = _mm512_loadu_ps(scale);
    for (int t = 0; t < MT; ++t)
      acc[t] = _mm512_fmadd_ps(_mm512_add_ps(even[t], odd[t]), s, acc[t]);
  }
  for (int t = 0; t < MT; ++t) _mm512_storeu_ps(c + size_t(t) * ldc, acc[t]);
}

}  // namespace

void avx512_gemm_fp8(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
                     size_t ldc) {
  const uint8_t* end = w.n_block(nb_end);
  const __m512i subnormals = fp8_subnormal_table();
  for (int nb = nb_begin; nb < nb_end; ++nb) {
    float* cn = c + (nb - nb_begin) * 16;
    for (int t = 0; t < a.m; t += kMaxTokens) {
      float* ct = cn + size_t(t) * ldc;
      switch (a.m - t >= kMaxTokens ? kMaxTokens : a.m - t) {
        case 1: fp8_tokens<1>(w, nb, a, t, ct, ldc, end, subnormals); break;
        case 2: fp8_tokens<2>(w, nb, a, t, ct, ldc, end, subnormals); break;
        case 3: fp8_tokens<3>(w, nb, a, t, ct, ldc, end, subnormals); break;
        default: fp8_tokens<4>(w, nb, a, t, ct, ldc, end, subnormals); break;
      }
    }
  }
}

}  // namespace hetmoe
