// AVX2 fp8 kernel, the fallback for CPUs without AVX-512: each row of 16 n x 2 k codes is split
// into its even-k and odd-k codes (vpshufb), turned into fp16 bit patterns that are the e4m3
// values times 2^-8 (exponent field and mantissa moved into place, subnormals included) and widened
// by vcvtph2ps, exact; fp32 FMAs against bf16 x, one sum per group, scaled by 256 x its scales.
#include <immintrin.h>

#include "kernels/gemm.h"

namespace hetmoe {
namespace {

constexpr int kMaxTokens = 4;

inline float bf16_value(uint16_t v) {
  return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(int(v) << 16)));
}

// 16 codes as fp16 patterns: sign to bit 15, exponent and mantissa (bits 0-6) to bits 7-13.
inline __m128i fp8_to_half_bits(__m128i bytes, __m128i* hi) {
  const __m256i x = _mm256_cvtepu8_epi16(bytes);
  const __m256i h = _mm256_or_si256(
      _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(0x3F80)),
      _mm256_and_si256(_mm256_slli_epi16(x, 8), _mm256_set1_epi16(int16_t(0x8000))));
  *hi = _mm256_extracti128_si256(h, 1);
  return _mm256_castsi256_si128(h);
}

// One row r of 16 n x 2 k codes -> even-k and odd-k values (x 2^-8) of n 0-7 and 8-15.
struct Row {
  __m256 even[2], odd[2];
  explicit Row(const uint8_t* p) {
    // Per 16 bytes (8 n x 2 k): the 8 even-k codes, then the 8 odd-k codes.
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i v = _mm256_shuffle_epi8(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), split);
    for (int h = 0; h < 2; ++h) {
      __m128i odd_bits;
      const __m128i even_bits = fp8_to_half_bits(
          h ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v), &odd_bits);
      even[h] = _mm256_cvtph_ps(even_bits);
      odd[h] = _mm256_cvtph_ps(odd_bits);
    }
  }
};

template <int MT>
void fp8_tokens(const PackedMatrix& w, int nb, const ActView& a, int t0, float* c, size_t ldc) {
  const int groups = w.num_groups(), gs = w.group_size;
  const uint8_t* row = w.n_block(nb);  // [K/2][16][2] codes
  const float* scale = w.scale + size_t(nb) * groups * kBlockN;
  const __m256 unhalf = _mm256_set1_ps(256.0f);  // the fp16 patterns are the values x 2^-8
  __m256 acc[MT][2];
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int g = 0; g < groups; ++g, scale += kBlockN) {
    __m256 d[MT][2];
    for (int t = 0; t < MT; ++t) d[t][0] = d[t][1] = _mm256_setzero_ps();
    for (int k = g * gs; k < (g + 1) * gs; k += 2, row += 32) {
      const Row r(row);
      for (int t = 0; t < MT; ++t) {
        const uint16_t* xt = a.bf16 + size_t(t0 + t) * a.ld + k;
        const __m256 xe = _mm256_set1_ps(bf16_value(xt[0])), xo = _mm256_set1_ps(bf16_value(xt[1]));
        for (int h = 0; h < 2; ++h)
          d[t][h] = _mm256_fmadd_ps(r.odd[h], xo, _mm256_fmadd_ps(r.even[h], xe, d[t][h]));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(scale + 8 * h), unhalf);
      for (int t = 0; t < MT; ++t) acc[t][h] = _mm256_fmadd_ps(d[t][h], s, acc[t][h]);
    }
  }
  for (int t = 0; t < MT; ++t) {
    _mm256_storeu_ps(c + size_t(t) * ldc, acc[t][0]);
    _mm256_storeu_ps(c + size_t(t) * ldc + 8, acc[t][1]);
  }
}

}  // namespace

void avx2_gemm_fp8(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
                   size_t ldc) {
  for (int nb = nb_begin; nb < nb_end; ++nb) {
    float* cn = c + (nb - nb_begin) * 16;
    for (int t = 0; t < a.m; t += kMaxTokens) {
      float* ct = cn + size_t(t) * ldc;
      switch (a.m - t >= kMaxTokens ? kMaxTokens : a.m - t) {
        case 1: fp8_tokens<1>(w, nb, a, t, ct, ldc); break;
        case 2: fp8_tokens<2>(w, nb, a, t, ct, ldc); break;
        case 3: fp8_tokens<3>(w, nb, a, t, ct, ldc); break;
        default: fp8_tokens<4>(w, nb, a, t, ct, ldc); break;
      }
    }
  }
}

}  // namespace hetmoe
