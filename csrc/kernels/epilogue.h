// Element-wise steps around the matrix kernels (SiLU(gate) * up, fp32 -> bf16, fp32 -> u8
// groups), written as plain loops that the compiler vectorizes for the ISA of the file that
// includes this header (internal linkage: each kernel file gets its own copy).
#pragma once

#include <cstdint>
#include <cstring>

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

// h[t][j] = silu(gate) * up for `cols` columns; c rows hold 16-wide gate and up blocks in turn.
inline void silu_mul_row(const float* __restrict c, int cols, float* __restrict h) {
  for (int b = 0; b < cols / 16; ++b)
    for (int l = 0; l < 16; ++l) {
      const float g = c[2 * b * 16 + l], u = c[(2 * b + 1) * 16 + l];
      h[b * 16 + l] = g / (1.0f + fast_exp(-g)) * u;
    }
}

inline void to_bf16_row(const float* __restrict x, int n, uint16_t* __restrict out) {
  for (int i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], 4);
    out[i] = uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
  }
}

// Asymmetric u8 per group (see layout/activation.h); n is a multiple of group_size.
inline void to_u8_row(const float* __restrict x, int n, int group_size, uint8_t* __restrict out,
                      float* scale, float* bias, float* sum) {
  for (int g = 0; g < n / group_size; ++g) {
    const float* xg = x + g * group_size;
    float lo = xg[0], hi = xg[0];
    for (int i = 1; i < group_size; ++i) {
      lo = xg[i] < lo ? xg[i] : lo;
      hi = xg[i] > hi ? xg[i] : hi;
    }
    const float inv = hi > lo ? 255.0f / (hi - lo) : 0.0f;
    int total = 0;
    for (int i = 0; i < group_size; ++i) {
      float v = (xg[i] - lo) * inv + 0.5f;
      v = v < 0 ? 0 : (v > 255.0f ? 255.0f : v);
      const uint8_t u = uint8_t(int(v));
      out[g * group_size + i] = u;
      total += u;
    }
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
