// AMX int4 "auto" (HETMOE_AMX_INT4=auto, amx.cpp): per call, the int8-tile kernel
// (amx_int4_i8.cpp) unless the call's rows are uneven across their groups, then the bf16-tile
// kernel (amx_int4.cpp) for that call. Decided on the rows' group metadata alone.
#pragma once

#include "kernels/gemm.h"

namespace hetmoe {

// The largest call spread of the rows' group magnitudes (largest over root mean square, summed
// over rows: amx_int4_auto.cpp) the int8-tile kernel is given. Measured on demo-moe's hidden
// states (docs/benchmarks/demo_moe.md): at 2 its kernel error is already 1.7x the bf16 tiles'
// (all gate/up calls there spread 2.2-3.4 and take bf16 tiles); Gaussian rows spread 1.3-1.6.
constexpr float kAmxInt4AutoMaxSpread = 2.0f;

// True when the rows r < a.m of `a` (num_groups u8 groups each) are even: sum_r max_g A_rg^2 <=
// spread^2 * sum_r mean_g A_rg^2, A_rg = max(|bias|, |255 scale + bias|) the largest |x| group g's
// u8 grid holds (why: amx_int4_auto.cpp).
bool int4_rows_even(const ActView& a, int num_groups, float spread);

// amx_gemm_int4_i8 when int4_rows_even(a, groups, kAmxInt4AutoMaxSpread), else amx_gemm_int4.
void amx_gemm_int4_auto(const PackedMatrix& w, const ActView& a, int nb_begin, int nb_end,
                        float* c, size_t ldc);

}  // namespace hetmoe
