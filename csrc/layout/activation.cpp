// Activation conversion and asymmetric u8 group quantization (see activation.h).
#include "layout/activation.h"

#include <algorithm>
#include <cmath>

#include "layout/bf16.h"

namespace hetmoe {

void activation_to_bf16(const float* x, int valid, int padded, uint16_t* out) {
  for (int i = 0; i < valid; ++i) out[i] = float_to_bf16(x[i]);
  std::fill(out + valid, out + padded, uint16_t(0));
}

void activation_to_u8(const float* x, int valid, int padded, int group_size, uint8_t* out,
                      float* scale, float* bias, float* sum) {
  for (int g = 0; g * group_size < padded; ++g) {
    const int begin = g * group_size, end = std::min(begin + group_size, valid);
    float lo = 0, hi = 0;
    if (begin < end) lo = hi = x[begin];
    for (int i = begin + 1; i < end; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
    // The zero padding of a partial group is part of its range.
    if (end < begin + group_size) lo = std::min(lo, 0.0f), hi = std::max(hi, 0.0f);
    const float s = (hi - lo) / 255.0f, inv = hi > lo ? 255.0f / (hi - lo) : 0.0f;
    int total = 0;
    for (int i = begin; i < begin + group_size; ++i) {
      const float v = i < end ? x[i] : 0.0f;
      const int u = int(std::nearbyint((v - lo) * inv));
      out[i] = uint8_t(std::clamp(u, 0, 255));
      total += out[i];
    }
    scale[g] = s;
    bias[g] = lo;
    sum[g] = s * float(total) + float(group_size) * lo;
  }
}

}  // namespace hetmoe
