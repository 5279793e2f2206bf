// Per-ISA kernels: C[m, 16 * (nb_end - nb_begin)] = A[m, K] x W[n-blocks]^T on packed weights.
//
// Activations come prepared once per call (to_u8_row in epilogue.h): bf16 rows for the bf16 and fp8
// formats;
// for int formats u8 rows quantized per (row, group) as x = scale * u + bias, so that
//   dot_group(x, w) = sw * sx * sum(u * q) + sw_qsum * bx + bias_w * xsum
// with sum(u * q) an exact int32 product (VNNI / AMX), and the rest a per-group fix-up.
#pragma once

#include <cstddef>
#include <cstdint>

#include "layout/packed_matrix.h"

namespace hetmoe {

struct ActView {
  int m = 0;                   // rows; for AMX, rows up to round_up(m, 16) are readable and zero
  size_t ld = 0;               // elements (bf16) or bytes (u8) between rows
  const uint16_t* bf16 = nullptr;
  const uint8_t* u8 = nullptr;
  const float* scale = nullptr;  // [m][groups]
  const float* bias = nullptr;   // [m][groups]
  const float* sum = nullptr;    // [m][groups] sum of the dequantized group
  size_t ldg = 0;                // floats between rows of scale/bias/sum
  // AMX only: 0 = rows row-major, ld apart; else bytes per tile row of A tiles stored in place:
  // [round_up(m, 16) / 16 blocks, 16 * ld elements each][ld bytes / tile_step][16][tile_step]
  // (64 for bf16, min(64, group size) for u8), so the kernel loads each 1 KB A tile as it lies.
  int tile_step = 0;
  // c is written once and read by another phase later (prefill's per-row down outputs, tens of
  // MB): the AMX kernels then store it with non-temporal stores, sparing the reads for
  // ownership of lines they overwrite whole. A hint; other kernels store as usual.
  bool stream_c = false;
};

// Writes c[t * ldc + (nb - nb_begin) * 16 + j] for t < round_up(m, 16) (rows >= m are garbage).
using GemmFn = void (*)(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end,
                        float* c, size_t ldc);

// Element-wise steps (kernels/epilogue.h), vectorized for the same ISA.
struct Epilogue {
  void (*silu_mul)(const float* c, int cols, float* h);
  void (*to_bf16)(const float* x, int n, uint16_t* out);
  void (*to_u8)(const float* x, int n, int group_size, uint8_t* out, float* scale, float* bias,
                float* sum);
  void (*axpy)(float w, const float* src, int n, float* dst);
};

struct IsaKernels {
  const char* name;
  GemmFn bf16;
  GemmFn int8;
  GemmFn int4;
  GemmFn fp8;  // bf16 activations; per group: (e4m3 codes widened to bf16) . x, times the scale
  Epilogue epilogue;
  GemmFn get(WeightFormat f) const {
    switch (f) {
      case WeightFormat::kBF16: return bf16;
      case WeightFormat::kINT8: return int8;
      case WeightFormat::kINT4: return int4;
      default: return fp8;
    }
  }
};

// AMX int4 on bf16 tiles (amx_int4.cpp; the other ISAs' int4 kernels are in their files).
void amx_gemm_int4(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
                   size_t ldc);
// AMX int4 on int8 tiles (amx_int4_i8.cpp, picked by dispatch.h's amx_int4_kernel()): rows and
// weights requantized to one int8 grid per row and per channel, int32 sums over all K. K at most
// kAmxInt4I8MaxK: layers past it are refused when made (moe_layer.cpp); the kernel's entry check
// (std::logic_error) only guards its invariants.
void amx_gemm_int4_i8(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end,
                      float* c, size_t ldc);
constexpr int kAmxInt4I8MaxK = 65536;

// The fp8 kernels, one file per ISA (reference.cpp, avx2_fp8.cpp, avx512_fp8.cpp, amx_fp8.cpp).
void reference_gemm_fp8(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end,
                        float* c, size_t ldc);
void avx2_gemm_fp8(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
                   size_t ldc);
void avx512_gemm_fp8(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
                     size_t ldc);
void amx_gemm_fp8(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end, float* c,
                  size_t ldc);

const IsaKernels& reference_kernels();
const IsaKernels& avx2_kernels();
const IsaKernels& avx512_kernels();
const IsaKernels& amx_kernels();

}  // namespace hetmoe
