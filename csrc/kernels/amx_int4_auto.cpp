// AMX int4 "auto": the int8-tile kernel for calls whose rows its one grid per row serves, the
// bf16-tile kernel for the rest. Why this spread: the int8-tile kernel requantizes a row onto one
// symmetric grid of step max_g A_g / 127 over all K, where its u8 groups had steps of about
// A_g / 127.5 each (A_g: the largest |x| group g's grid holds). Rounding noise is uniform within
// a step, so a row's noise power goes from about sum_g gs A_g^2 to K max_g A_g^2 (over 12 * 127^2):
// the requantization multiplies the activation noise (standard deviation) by max_g A_g / rms_g A_g.
// Over a call's rows, its error in norm (what the layer error measures) follows the rows' summed
// powers: spread^2 = G sum_r max_g A_rg^2 / sum_r sum_g A_rg^2. A single row's worst ratio would
// refuse every call of heavy-tailed rows (silu(gate) * up of Gaussian rows: 3.8 at groups of 32
// in calls of 16 rows or more) for one row's sake. Every task of an expert sees the same rows and decides
// the same.
#include "kernels/amx_int4_auto.h"

#include <algorithm>
#include <cmath>

namespace hetmoe {

bool int4_rows_even(const ActView& a, int num_groups, float spread) {
  double tops = 0, sums = 0;  // sum_r max_g A_rg^2, sum_r sum_g A_rg^2
  for (int r = 0; r < a.m; ++r) {
    const float* scale = a.scale + size_t(r) * a.ldg;
    const float* bias = a.bias + size_t(r) * a.ldg;
    float top = 0;
    for (int g = 0; g < num_groups; ++g) {
      const float mag = std::max(std::fabs(bias[g]), std::fabs(scale[g] * 255.0f + bias[g]));
      top = std::max(top, mag * mag);
      sums += mag * mag;
    }
    tops += top;
  }
  return double(num_groups) * tops <= double(spread) * spread * sums;
}

void amx_gemm_int4_auto(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end,
                        float* c, size_t ldc) {
  const bool even = int4_rows_even(a, w.num_groups(), kAmxInt4AutoMaxSpread);
  (even ? amx_gemm_int4_i8 : amx_gemm_int4)(w, a, nb_begin, nb_end, c, ldc);
}

}  // namespace hetmoe
