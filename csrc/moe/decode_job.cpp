// decode_job: a call of q <= kDecodeMaxTokens tokens as two phases (call_plan.h).
#include <algorithm>

#include "moe/call_job.h"
#include "moe/expert_tasks.h"

namespace hetmoe {
namespace {

// Adds group gg's rows of token t, weighted, in expert order, over columns [c0, c0 + width).
void weigh_rows(const MoECallState& st, int gg, int t, int c0, int width, float* acc) {
  const Routing& r = st.routing;
  const Epilogue& ep = st.plan.epilogue();
  const int Hn = st.plan.hidden_rows;
  for (size_t a = 0; st.layer.slice(gg) > 0 && a < r.experts.size(); ++a)
    for (long row = r.first_row[a]; row < r.first_row[a] + r.rows[a]; ++row)
      if (r.row_token[row] == t)
        ep.axpy(r.row_weight[row], st.row_out[gg] + size_t(row) * Hn + c0, width, acc);
}

// 5: per (token, column chunk): each group's rows weighted in expert order, then the groups
// summed (the order of prefill's column-block down: the same floats).
void combine_task(const MoECallState& st, size_t task, int g) {
  const CallPlan& p = st.plan;
  const int G = p.groups, H = p.hidden, chunks = (H + kCombineCols - 1) / kCombineCols;
  const int chunk = int(task) * G + g;
  if (chunk >= st.call.q * chunks) return;
  const int t = chunk / chunks, c0 = (chunk % chunks) * kCombineCols;
  const int width = std::min(kCombineCols, H - c0);
  float* total = scratch(2 * kCombineCols);
  float* part = total + kCombineCols;
  bool first = true;
  for (int gg = 0; gg < G; ++gg) {
    if (st.layer.slice(gg) == 0 && gg > 0) continue;
    float* acc = first ? total : part;
    std::fill_n(acc, width, 0.0f);
    weigh_rows(st, gg, t, c0, width, acc);
    if (!first)
      for (int i = 0; i < width; ++i) total[i] += part[i];
    first = false;
  }
  store_cols(st.call, H, t, c0, width, total);
}

}  // namespace

void convert_tokens(MoECallState& st) {
  for (int t = 0; t < st.call.q; ++t) convert_token(st, t);
}

PhaseList decode_job(const std::shared_ptr<MoECallState>& st) {
  PhaseList phases;
  // 3 + 4: every gate/up task (bind_plan may lower their count), then every down task.
  phases.add(kGateUpDown, st->plan.gate_up_tasks + st->plan.down_tasks,
             [st](size_t task, int g, int) {
               const size_t split = st->plan.gate_up_tasks;
               if (task < split) gate_up_task(*st, task, g);
               else down_rows_task(*st, task - split, g);
             });
  phases.add(kCombine, st->plan.combine_tasks,
             [st](size_t task, int g, int) { combine_task(*st, task, g); });
  return phases;
}

}  // namespace hetmoe
