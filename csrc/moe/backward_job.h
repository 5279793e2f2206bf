// Backward of the routed experts for training with frozen (packed) weights: given dY of
// out[q, H] = sum_j w_j * down_e(silu(gate_e x) * up_e x), computes
//   dx[t]        = sum_j  J_e(x_t)^T (w_j dY_t)     (through down, the SiLU gate and gate/up)
//   dweights[t,j] = <dY_t, down_e(silu(gate_e x_t) * up_e x_t)>
// as fp32 GEMMs over each expert's rows on panels unpacked from the layer's packed n-blocks
// (kernels/grad.h). The activations are recomputed from x in fp32 on the same weights,
// dequantized exactly (no activation rounding). With bf16_math (bf16 training) on an ISA with
// bf16 GEMMs (AVX-512, AMX) the forward's kernels compute all three products instead: x, dY and
// the SiLU's gradient rounded to bf16 (x to u8 per group for the int formats' recompute, as the
// forward rounds it), the weights as packed (transposed panels: bf16 of the dequantized values).
#pragma once

#include <cstdint>

#include "moe/moe_layer.h"
#include "runtime/pool.h"

namespace hetmoe {

struct MoEGradCall {
  const void* x = nullptr;  // [q, H]
  DType x_type = DType::kFP32;
  const int64_t* ids = nullptr;     // [q, k], -1 = skipped
  const float* weights = nullptr;   // [q, k]
  int q = 0, k = 0;
  const float* dy = nullptr;        // [q, H] fp32; nullptr: no backward (out only)
  float* dx = nullptr;              // [q, H] fp32, written with dy
  float* dweights = nullptr;        // [q, k] fp32, written with dy (0 for skipped slots)
  float* out = nullptr;             // [q, H] fp32 (nullable): the forward itself, recomputed in
                                    // fp32 (the exact forward of fp32 training)
  const uint8_t* gpu_mask = nullptr;  // num_experts flags (nullable): skipped like -1
  const uint8_t* loaded = nullptr;    // num_experts flags: a routed expert must be loaded
  bool bf16_math = false;             // the forward's bf16 / AMX kernels (see above)
};

// Runs on `pool` and returns when done. Kernel family: the layer's max_isa (fp32 math on AMX
// layers uses the AVX-512 kernels; bf16 math falls back to fp32 math below AVX-512). Throws std::out_of_range for an id outside
// [-1, num_experts), std::runtime_error for a routed expert never loaded.
void moe_backward(const MoELayer& layer, ThreadPool& pool, const MoEGradCall& call);

}  // namespace hetmoe
