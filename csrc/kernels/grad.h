// Backward kernels of the frozen experts (moe/backward_job.cpp): an n-block of a packed matrix
// read back as 16 fp32 rows, and the two row products that both directions build on it:
//   forward  c[n]  = dot(x, W[n])      (x W^T, the recomputed activations)
//   backward dx   += a[n] * W[n]       (a W, the transposed product)
// One file per ISA beside a scalar reference, like the forward kernels (gemm.h).
#pragma once

#include <cstddef>

#include "layout/packed_matrix.h"

namespace hetmoe {

struct GradKernels {
  const char* name;
  // out[n * ld + k] = W[16 nb + n, k] for n < 16, k < w.k (int formats dequantized in fp32:
  // int8 scale * q, int4 scale * q + bias; fp8 scale * e4m3).
  void (*unpack)(const PackedMatrix& w, int nb, float* out, size_t ld);
  float (*dot)(const float* a, const float* b, int n);
  // dst[j] += w * src[j]
  void (*axpy)(float w, const float* src, int n, float* dst);
};

const GradKernels& reference_grad_kernels();
const GradKernels& avx2_grad_kernels();
const GradKernels& avx512_grad_kernels();

}  // namespace hetmoe
