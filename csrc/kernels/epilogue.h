// Element-wise steps around the matrix kernels (SiLU(gate) * up, fp32 -> bf16, fp32 -> u8
// groups) for the ISA of the file that includes this header (internal linkage: each kernel file
// gets its own copy). Plain loops where the compiler vectorizes them; SiLU and the u8 groups also
// have AVX-512 forms (the compiler leaves their floor, selects and narrowing scalar, ~8 and ~4 ns
// per value), which do the same float operations in the same order: every ISA gets the same bits.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace hetmoe {
namespace {

// exp(x) to ~2 ulp for x in [-87, 88]: 2^n * p(f) with a degree-6 polynomial, branch-free.
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float y = x * 1.44269504f;
  const float n = __builtin_floorf(y + 0.5f);
  const float f = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // x - n ln2, two-part
  float p = 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#ifdef __AVX512F__
// fast_exp on 16 lanes, operation for operation.
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_min_ps(_mm512_set1_ps(88.0f), x));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(y, _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145752f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(1.42860677e-6f)));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float k : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(k));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// h[t][j] = silu(gate) * up for `cols` columns; c rows hold 16-wide gate and up blocks in turn.
inline void silu_mul_row(const float* __restrict c, int cols, float* __restrict h) {
  for (int b = 0; b < cols / 16; ++b) {
#ifdef __AVX512F__
    const __m512 g = _mm512_loadu_ps(c + 2 * b * 16), u = _mm512_loadu_ps(c + (2 * b + 1) * 16);
    const __m512 e = fast_exp16(_mm512_xor_ps(g, _mm512_set1_ps(-0.0f)));  // exp(-g)
    _mm512_storeu_ps(h + b * 16, _mm512_mul_ps(
        _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u));
#else
    for (int l = 0; l < 16; ++l) {
      const float g = c[2 * b * 16 + l], u = c[(2 * b + 1) * 16 + l];
      h[b * 16 + l] = g / (1.0f + fast_exp(-g)) * u;
    }
#endif
  }
}

inline void to_bf16_row(const float* __restrict x, int n, uint16_t* __restrict out) {
  for (int i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], 4);
    out[i] = uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
  }
}

// Asymmetric u8 per group (the fix-up is in gemm.h); n is a multiple of group_size (>= 32).
// The group's min and max are taken over 16 lanes, then across the lanes in order, so that the
// AVX-512 form picks the same values (down to the sign of a zero) as the plain one.
inline void to_u8_row(const float* __restrict x, int n, int group_size, uint8_t* __restrict out,
                      float* scale, float* bias, float* sum) {
  for (int g = 0; g < n / group_size; ++g) {
    const float* xg = x + g * group_size;
    uint8_t* og = out + g * group_size;
    float lo16[16], hi16[16];
    int total = 0;
#ifdef __AVX512F__
    __m512 vlo = _mm512_loadu_ps(xg), vhi = vlo;
    for (int i = 16; i < group_size; i += 16) {
      const __m512 v = _mm512_loadu_ps(xg + i);
      vlo = _mm512_min_ps(v, vlo);  // v < lo ? v : lo
      vhi = _mm512_max_ps(v, vhi);  // v > hi ? v : hi
    }
    _mm512_storeu_ps(lo16, vlo);
    _mm512_storeu_ps(hi16, vhi);
#else
    for (int l = 0; l < 16; ++l) lo16[l] = hi16[l] = xg[l];
    for (int i = 16; i < group_size; i += 16)
      for (int l = 0; l < 16; ++l) {
        const float v = xg[i + l];
        lo16[l] = v < lo16[l] ? v : lo16[l];
        hi16[l] = v > hi16[l] ? v : hi16[l];
      }
#endif
    float lo = lo16[0], hi = hi16[0];
    for (int l = 1; l < 16; ++l) {
      lo = lo16[l] < lo ? lo16[l] : lo;
      hi = hi16[l] > hi ? hi16[l] : hi;
    }
    const float inv = hi > lo ? 255.0f / (hi - lo) : 0.0f;
#ifdef __AVX512F__
    const __m512 vl = _mm512_set1_ps(lo), vi = _mm512_set1_ps(inv);
    __m512i vt = _mm512_setzero_si512();
    for (int i = 0; i < group_size; i += 16) {
      __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(xg + i), vl), vi),
                               _mm512_set1_ps(0.5f));
      v = _mm512_max_ps(_mm512_setzero_ps(), _mm512_min_ps(_mm512_set1_ps(255.0f), v));
      const __m512i q = _mm512_cvttps_epi32(v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(og + i), _mm512_cvtepi32_epi8(q));
      vt = _mm512_add_epi32(vt, q);
    }
    total = _mm512_reduce_add_epi32(vt);
#else
    for (int i = 0; i < group_size; ++i) {
      float v = (xg[i] - lo) * inv + 0.5f;
      v = v < 0 ? 0 : (v > 255.0f ? 255.0f : v);
      const uint8_t u = uint8_t(int(v));
      og[i] = u;
      total += u;
    }
#endif
    scale[g] = (hi - lo) / 255.0f;
    bias[g] = lo;
    sum[g] = scale[g] * float(total) + float(group_size) * lo;
  }
}

// dst[j] += w * src[j]
inline void axpy_row(float w, const float* __restrict src, int n, float* __restrict dst) {
  for (int j = 0; j < n; ++j) dst[j] += w * src[j];
}

}  // namespace
}  // namespace hetmoe
