// Per-call activation preparation: one row of fp32 activations into the kernels' input form
// (kernels/gemm.h): bf16 for the bf16 format, u8 with per-group scale/bias/sum for int formats.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hetmoe {

// x[valid] -> out[padded], zero past `valid`.
void activation_to_bf16(const float* x, int valid, int padded, uint16_t* out);

// x[valid] -> u8[padded] with x ~= scale[g] * u + bias[g] per group of `group_size`, and sum[g]
// the sum of the dequantized group. Groups past `valid` are zero.
void activation_to_u8(const float* x, int valid, int padded, int group_size, uint8_t* out,
                      float* scale, float* bias, float* sum);

}  // namespace hetmoe
