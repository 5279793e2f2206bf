// The state of one MoE call that its job's tasks share: the call, its routing and plan, the
// layer's weights, workspace views and the counters decode tasks synchronize on.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "layout/packed_matrix.h"
#include "moe/act_store.h"
#include "moe/call_plan.h"
#include "moe/routing.h"
#include "moe/workspace.h"

namespace hetmoe {

// What a call's tasks read of their layer (MoELayer owns it and outlives its jobs).
struct LayerRef {
  const int* slice_begin = nullptr;       // [G + 1]: group g's intermediate columns
  const PackedMatrix* gate_up = nullptr;  // [G * E]
  const PackedMatrix* down = nullptr;     // [G * E]
  int num_experts = 0;

  int slice(int g) const { return slice_begin[g + 1] - slice_begin[g]; }
  const PackedMatrix& gate_up_of(int g, int e) const {
    return gate_up[size_t(g) * num_experts + e];
  }
  const PackedMatrix& down_of(int g, int e) const { return down[size_t(g) * num_experts + e]; }
};

struct MoECallState {
  MoECall call;
  Routing routing;
  CallPlan plan;
  LayerRef layer;
  std::shared_ptr<Workspace> ws;
  ActStore tokens, rows;
  std::vector<ActStore> hidden;  // per NUMA group
  std::vector<float*> accum;     // per NUMA group, [q][H] (down by column blocks)
  std::vector<float*> row_out;   // per NUMA group, [rows][H] (down by row)
  // Prefill: per 16-row block of the rows, nonzero = its expert's rows are in tile order.
  std::vector<uint8_t> tiled_block;
  // Decode: per active expert 0 = rows not gathered, 1 = being gathered, 2 = ready.
  std::unique_ptr<std::atomic<int>[]> rows_state;
  // Decode: the converted tokens, owned by the call (they are written when the job is made or
  // bound, while earlier jobs may still be using the shared workspace).
  std::unique_ptr<uint8_t, decltype(&std::free)> token_buf{nullptr, &std::free};
  // Decode with split groups: per NUMA group [rows][Ig] fp32 hidden values, and per (NUMA
  // group, active expert, quantization group) the tasks that have written their part.
  std::vector<float*> hidden_float;
  std::unique_ptr<std::atomic<int>[]> parts_done;
  // Decode: per (NUMA group, active expert) the gate/up tasks done, which the expert's down tasks
  // wait for; `expert_stride` = the active experts the job was made for.
  std::unique_ptr<std::atomic<int>[]> gate_up_done;
  size_t expert_stride = 0;
};

// The state of `call` routed as `routing` and planned as `plan`: its workspace views, and for
// decode its token buffer and counters.
std::shared_ptr<MoECallState> make_call_state(const MoECall& call, Routing routing,
                                              const CallPlan& plan, const LayerRef& layer);

}  // namespace hetmoe
