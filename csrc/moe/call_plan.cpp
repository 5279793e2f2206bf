// plan_call: the mode, task counts and workspace of one MoE call (call_plan.h).
#include "moe/call_plan.h"

#include <cmath>

namespace hetmoe {
namespace {

constexpr int kRowsForRowOut = 32;  // rows on one expert from which prefill's down goes by expert
constexpr int kRowOutBlocks = 16;   // n-blocks (256 outputs) per (expert, column block) task

int slice_of(const std::vector<int>& slice_begin, int g) {
  return slice_begin[g + 1] - slice_begin[g];
}

// Tasks per group rounded up: phases that split their tasks across the NUMA groups.
size_t per_group(int total, int groups) { return size_t((total + groups - 1) / groups); }

// Decode down tasks are runs of n-blocks of one expert: the longest run (of 16, 8, 4, 2, 1) that
// leaves the phase's last round of tasks at most 7 % idle on `workers` cores, else the least idle.
int down_run_blocks(size_t experts, int nbs, int workers) {
  int best = 1;
  double best_idle = 1e9;
  for (int b : {16, 8, 4, 2, 1}) {
    const double rounds = double(experts * size_t((nbs + b - 1) / b)) / workers;
    const double idle = rounds > 0 ? std::ceil(rounds) / rounds - 1 : 0;
    if (idle <= 0.07) return b;
    if (idle < best_idle) best = b, best_idle = idle;
  }
  return best;
}

// Sizes, mode and the derived choices.
void plan_shape(CallPlan& p, const MoEConfig& cfg, int groups, int hidden_padded, int q,
                const Routing& routing) {
  // u8 activations are quantized per group; bf16 and fp8 weights take bf16 rows (fp8's weight
  // groups are the kernels' business only).
  const bool quantized = u8_activations(cfg.format);
  p.q = q;
  p.hidden = cfg.hidden;
  p.hidden_padded = hidden_padded;
  p.hidden_rows = int(round_up(cfg.hidden, kBlockN));
  p.groups = groups;
  p.group_size = quantized ? cfg.group_size : 0;
  p.elem = quantized ? 1 : 2;
  p.rows = size_t(routing.total_rows);
  p.token_groups = quantized ? hidden_padded / cfg.group_size : 0;
  p.format = cfg.format;
  p.max_isa = cfg.max_isa;
  p.amx_min_tokens = cfg.amx_min_tokens;
  p.row_out = routing.max_rows >= kRowsForRowOut;
  p.mode = q <= kDecodeMaxTokens && !p.row_out ? CallMode::kDecode : CallMode::kPrefill;
  p.by_row = p.row_out || p.decode();
  // Decode tasks narrower than a group write fp32 values; the last part quantizes the group.
  p.split_groups = p.decode() && p.group_size > cfg.decode_cols;
  p.store_in_down = groups == 1 && !p.by_row;
}

// Gate/up columns per task: whole quantization groups; 32 for decode (many tasks balance the
// cores), up to 128 (256 from kRowsForRowOut rows) for prefill (each task re-reads its expert's
// rows: fewer, wider tasks). Decode with a group wider than decode_cols (int8 128, say: 6 tasks of
// 512 KB per expert) would leave few, long tasks: such groups are split into parts.
int gate_up_cols(const CallPlan& p, const std::vector<int>& slice_begin, int max_rows,
                 int decode_cols) {
  if (p.split_groups) return decode_cols;
  auto divides_slices = [&](int c) {
    for (int g = 0; g < p.groups; ++g)
      if (slice_of(slice_begin, g) % c) return false;
    return true;
  };
  int cols = std::max(2 * kBlockN, p.group_size);
  const int max_cols = p.row_out ? 256 : 128;
  while (max_rows >= 16 && cols < max_cols && divides_slices(2 * cols)) cols *= 2;
  return cols;
}

size_t gate_up_task_count(const std::vector<int>& slice_begin, size_t experts, int cols) {
  size_t most = 0;
  for (size_t g = 0; g + 1 < slice_begin.size(); ++g)
    most = std::max(most, experts * (slice_of(slice_begin, int(g)) / cols));
  return most;
}

void plan_gate_up(CallPlan& p, const MoEConfig& cfg, const std::vector<int>& slice_begin,
                  const Routing& routing) {
  p.cols = gate_up_cols(p, slice_begin, routing.max_rows, cfg.decode_cols);
  p.parts = p.split_groups ? p.group_size / p.cols : 1;
  for (int g = 0; p.group_size && g < p.groups; ++g)
    p.max_groups = std::max(p.max_groups, size_t(slice_of(slice_begin, g) / p.group_size));
  p.gate_up_tasks = gate_up_task_count(slice_begin, routing.experts.size(), p.cols);
}

// Down and combine. By row: decode runs are as long as leaves the phase's last round of tasks
// little idle, prefill runs are kRowOutBlocks; else one n-block of outputs per task.
void plan_down(CallPlan& p, size_t experts, int workers) {
  const int nbs = p.hidden_rows / kBlockN, token_tasks = (p.q + kTokensPerTask - 1) / kTokensPerTask;
  if (!p.by_row) {
    p.down_tasks = size_t(nbs);
    p.combine_tasks = p.store_in_down ? 0 : per_group(token_tasks, p.groups);
    return;
  }
  p.down_run = p.decode() ? down_run_blocks(experts, nbs, workers) : kRowOutBlocks;
  p.down_per_expert = (nbs + p.down_run - 1) / p.down_run;
  p.down_tasks = experts * p.down_per_expert;
  const int chunks = (p.hidden + kCombineCols - 1) / kCombineCols;
  p.combine_tasks = per_group(p.decode() ? p.q * chunks : token_tasks, p.groups);
}

std::array<size_t, kNumRegions> workspace_bytes(const CallPlan& p, size_t inter_padded) {
  const size_t q = size_t(p.q), R = p.rows, Hp = size_t(p.hidden_padded);
  const size_t Hn = size_t(p.hidden_rows);
  const size_t G = size_t(p.groups);
  const bool quantized = u8_activations(p.format);
  std::array<size_t, kNumRegions> need{};
  need[kTokenAct] = q * Hp * p.elem;
  need[kTokenGroups] = 3 * q * p.token_groups * 4;
  need[kRowAct] = R * Hp * p.elem;
  need[kRowGroups] = 3 * R * p.token_groups * 4;
  need[kHidden] = R * inter_padded * p.elem;
  need[kHiddenGroups] = quantized ? 3 * R * (inter_padded / p.group_size) * 4 : 0;
  need[kAccum] = p.by_row ? 0 : G * q * Hn * 4;
  need[kRowOut] = p.by_row ? G * R * Hn * 4 : 0;
  need[kHiddenFloat] = p.split_groups ? R * inter_padded * 4 : 0;
  return need;
}

}  // namespace

CallPlan plan_call(const MoEConfig& cfg, const std::vector<int>& slice_begin, int hidden_padded,
                   int q, const Routing& routing, int workers) {
  CallPlan p;
  plan_shape(p, cfg, int(slice_begin.size()) - 1, hidden_padded, q, routing);
  if (!p.decode()) {
    p.convert_tasks = per_group((q + kTokensPerTask - 1) / kTokensPerTask, p.groups);
    p.gather_tasks = per_group(int(p.rows / kRowsPerTask), p.groups);
  }
  plan_gate_up(p, cfg, slice_begin, routing);
  plan_down(p, routing.experts.size(), workers);
  p.workspace = workspace_bytes(p, size_t(slice_begin.back()));
  return p;
}

Routing most_experts_routing(const MoECall& call, int num_experts) {
  const int slots = (call.end_slot < 0 ? call.k : call.end_slot) - call.first_slot;
  const int most = std::min(call.q * slots, num_experts);
  Routing routing;
  routing.experts.assign(most, 0);
  routing.total_rows = 16L * most;
  routing.max_rows = call.q;
  return routing;
}

void bind_plan(CallPlan& plan, const std::vector<int>& slice_begin, size_t experts) {
  plan.gate_up_tasks = gate_up_task_count(slice_begin, experts, plan.cols);
  plan.down_tasks = experts * plan.down_per_expert;
}

}  // namespace hetmoe
