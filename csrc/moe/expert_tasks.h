// Tasks of a MoE call's phases that decode and prefill share (call_plan.h lists the phases), and
// the per-row helpers of the others. Each runs one task index of one NUMA group.
#pragma once

#include <cstddef>

#include "moe/call_state.h"

namespace hetmoe {

// Gate and up of one expert's block of plan.cols intermediate columns, SiLU(gate) * up -> its
// hidden activations. Decode: reads the tokens in place or gathers them first (the expert's first
// task), and counts itself done for the expert's down tasks.
void gate_up_task(MoECallState& st, size_t task, int g);

// Down of one run of n-blocks of one expert into its rows' outputs. Decode: waits for the
// expert's gate/up tasks first (they are one phase).
void down_rows_task(MoECallState& st, size_t task, int g);

// Token t of the call's x in the kernels' input form (zero-padded to Hp) into row t of tokens.
void convert_token(const MoECallState& st, int t);

// out[t, col0:col0+n] = row[0:n] in the call's output dtype.
void store_cols(const MoECall& c, int H, int t, int col0, int n, const float* row);

// A worker's scratch floats (grown as needed, kept for its next task).
float* scratch(size_t floats);

}  // namespace hetmoe
