// Backward kernels of the frozen experts (moe/backward_job.cpp): register-blocked fp32 GEMMs over
// all of an expert's rows, fed by weight panels unpacked once per pass from the packed n-blocks
// (dequantized exactly: int8 scale q, int4 scale q + bias, fp8 scale e4m3):
//   recompute  c  = x W^T   panels of 2 n-blocks' columns, k-major   (unpack_cols)
//   transposed dx = a W     panels of 32 columns over many rows     (unpack_rows)
// and the SiLU between them. bf16 math (moe/backward_job.cpp) runs the forward's GEMMs instead:
//   transposed panels   32 columns of W as a bf16 PackedMatrix of W^T   (pack_transposed)
// One file per ISA beside a scalar reference, like the forward kernels (gemm.h).
#pragma once

#include <cstddef>

#include "layout/packed_matrix.h"

namespace hetmoe {

struct GradKernels {
  const char* name;
  // out[(k - k0) * ld + n] = W[16 nb + n, k] for n < 16, k0 <= k < k1 (multiples of 16).
  void (*unpack_cols)(const PackedMatrix& w, int nb, int k0, int k1, float* out, size_t ld);
  // The same values row-major: out[n * ld + (k - k0)].
  void (*unpack_rows)(const PackedMatrix& w, int nb, int k0, int k1, float* out, size_t ld);
  // c[i * ldc + j] (+= with accumulate) sum_r a[i * lda + r] * b[r * cols + j] for i < m,
  // r < depth, j < cols (16 or 32).
  void (*gemm)(int m, int depth, const float* a, size_t lda, const float* b, int cols, float* c,
               size_t ldc, bool accumulate);
  // One row of c ([gate 16, up 16] column pairs, cols gate columns): sig = sigmoid(gate),
  // h = gate * sig * up (the forward's SiLU, exp to ~2 ulp; sig kept for the backward).
  void (*silu)(const float* c, int cols, float* h, float* sig);
  // Columns [k0, k0 + 32) of w transposed into a bf16 PackedMatrix of n = 32, k =
  // round_up(w.n, 64) (element (j, r) = bf16(W[r, k0 + j]) of the dequantized value, rounded to
  // nearest even; rows of W past w.n zero) at `out` (64-byte aligned, 2 * k * 32 bytes).
  // nullptr where the ISA has no bf16 GEMM (scalar, AVX2).
  void (*pack_transposed)(const PackedMatrix& w, int k0, uint8_t* out);
};

const GradKernels& reference_grad_kernels();
const GradKernels& avx2_grad_kernels();
const GradKernels& avx512_grad_kernels();

}  // namespace hetmoe
