// The plan of one MoE call, decided once from its routing before any phase is built: its sizes,
// its mode, which phases run with how many tasks per NUMA group, and the workspace it needs.
// Phases (decode_job.cpp and prefill_job.cpp build them):
//   prefill: 1 tokens -> kernel input form   2 rows gathered per expert (16-row aligned)
//            3 gate/up + SiLU per (expert, column block)
//            4 down: per output column block over every expert into per-group partial outputs,
//              or (row_out: an expert with >= kRowsForRowOut rows) per (expert, 16 n-blocks)
//              into per-row outputs, so a task reads its expert's activations once
//            5 combine: the groups' partials (skipped with one group: 4 writes out) or each
//              token's weighted rows -> out
//   decode (q <= kDecodeMaxTokens): tokens converted when the job is made; 3 and 4 as ONE phase
//            (every gate/up task, then every down task, claimed in that order; a down task
//            waits for its expert's gate/up tasks: no barrier between them); 4 as runs of
//            n-blocks of one expert into per-row outputs; 5 per (token, kCombineCols columns)
//            in expert order.
// Phases 3 and 4 run in every NUMA group over its own intermediate slice; the others split their
// tasks across the groups.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <vector>

#include "dispatch.h"
#include "kernels/gemm.h"
#include "moe/moe_layer.h"
#include "moe/routing.h"
#include "moe/workspace.h"

namespace hetmoe {

inline constexpr int kDecodeMaxTokens = 4;  // max q of a decode call
inline constexpr int kTokensPerTask = 4;    // tokens per convert / prefill combine task
inline constexpr int kRowsPerTask = 16;     // one 16-row block per gather task (tiled whole)
inline constexpr int kCombineCols = 256;    // output columns per decode combine task

// Slots of phase_us() and take_timeline(): a decode's one gate/up + down phase (kGateUpDown)
// reports its gate/up and down tasks in their own slots.
enum PhaseSlot { kConvert, kGather, kGateUp, kDown, kCombine, kNumSlots, kGateUpDown = kNumSlots };

enum class CallMode { kDecode, kPrefill };

inline const IsaKernels& kernels_of(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return amx_kernels();
    case Isa::kAvx512: return avx512_kernels();
    case Isa::kAvx2: return avx2_kernels();
    default: return reference_kernels();
  }
}

struct CallPlan {
  CallMode mode = CallMode::kPrefill;
  // Sizes.
  int q = 0;                     // tokens
  int hidden = 0;                // H
  int hidden_padded = 0;         // Hp: H padded to whole k-blocks and groups (x's columns)
  int hidden_rows = 0;           // Hn: H padded to whole n-blocks (down's rows, the stride of
                                 // per-row and per-group outputs; out keeps H columns)
  int groups = 0;                // G: NUMA groups
  int group_size = 0;            // activations' u8 group (0: bf16 rows, for bf16 and fp8)
  size_t elem = 2;               // bytes per activation: 2 (bf16) or 1 (u8)
  size_t rows = 0;               // R: routed rows, each expert's padded to 16
  size_t token_groups = 0;       // quantization groups per activation row (Hp / group_size)
  WeightFormat format = WeightFormat::kBF16;
  Isa max_isa = Isa::kScalar;
  int amx_min_tokens = 0;        // rows from which an expert runs on AMX tiles
  // Named derived choices.
  bool row_out = false;          // prefill, some expert has >= kRowsForRowOut rows: 4 per expert
  bool by_row = false;           // 4 writes per-row outputs that 5 sums (decode or row_out)
  bool split_groups = false;     // decode, groups wider than decode_cols: `parts` tasks each
  bool store_in_down = false;    // one NUMA group, 4 by column blocks: 4 writes out, no 5
  // Phases: tasks per NUMA group (prefill: convert, gather, gate/up, down, combine unless
  // store_in_down; decode: gate/up + down, combine).
  size_t convert_tasks = 0;
  size_t gather_tasks = 0;
  int cols = 0;                  // gate/up columns per task
  int parts = 1;                 // gate/up tasks per quantization group
  size_t max_groups = 0;         // most quantization groups in one NUMA group's slice
  size_t gate_up_tasks = 0;      // the most over the NUMA groups
  int down_run = 0;              // by_row: n-blocks per down task
  int down_per_expert = 0;       // by_row: down tasks per expert
  size_t down_tasks = 0;
  size_t combine_tasks = 0;
  std::array<size_t, kNumRegions> workspace{};  // bytes per region

  bool decode() const { return mode == CallMode::kDecode; }
  // AMX tiles for an expert of m rows; only they read its padding rows (to 16).
  bool amx_rows(int m) const { return max_isa == Isa::kAmx && m >= amx_min_tokens; }
  // Prefill keeps the rows and hidden activations of AMX experts in tile order (act_store.h).
  bool tiled_rows(int m) const { return !decode() && amx_rows(m); }
  Isa small_isa() const { return std::min(max_isa, Isa::kAvx512); }
  const IsaKernels& kernels_for(int m) const {
    return kernels_of(amx_rows(m) ? Isa::kAmx : small_isa());
  }
  const Epilogue& epilogue() const { return kernels_of(small_isa()).epilogue; }
};

// The plan of a call of q tokens routed as `routing`, on a layer whose NUMA group g holds the
// intermediate columns [slice_begin[g], slice_begin[g + 1]); `workers`: the first group's size.
CallPlan plan_call(const MoEConfig& cfg, const std::vector<int>& slice_begin, int hidden_padded,
                   int q, const Routing& routing, int workers);

// A stand-in routing for a decode call whose ids are not written yet: the most experts it can
// reach, each padded to 16 rows. Its plan sizes the job; bind_plan then counts the routed ones.
Routing most_experts_routing(const MoECall& call, int num_experts);

// The gate/up and down task counts of a planned decode call once routed to `experts` experts
// (the columns per task and the runs of n-blocks stay as planned).
void bind_plan(CallPlan& plan, const std::vector<int>& slice_begin, size_t experts);

}  // namespace hetmoe
