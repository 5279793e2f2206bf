// prefill_job: a call of more than kDecodeMaxTokens tokens (or rows) as four or five phases
// (call_plan.h). The rows and hidden activations of experts on AMX tiles are written in tile
// order (act_store.h) by the gather and the gate/up epilogue, so every AMX task reads its A
// tiles in place instead of copying its expert's rows again.
#include <algorithm>
#include <cstring>

#include "layout/bf16.h"
#include "moe/call_job.h"
#include "moe/expert_tasks.h"

namespace hetmoe {
namespace {

// The AVX-512 bf16 / int4 kernels prefetch every line this far ahead within one call; a column
// down task calls them on one short n-block per expert, so it fetches the start of the next
// expert's while the current one runs.
constexpr size_t kLeadBytes = 4096;

void prefetch_start(const uint8_t* p, size_t bytes) {
  for (size_t i = 0; i < std::min(bytes, kLeadBytes); i += 64) __builtin_prefetch(p + i, 0, 3);
}

// dst[j] += w * src[j] (the compiler vectorizes it for the baseline ISA of this file).
void add_scaled(float w, const float* __restrict src, int n, float* __restrict dst) {
  for (int j = 0; j < n; ++j) dst[j] += w * src[j];
}

// out[t] = row (H floats) in the call's output dtype.
void store_row(const MoECall& c, int H, int t, const float* row) {
  if (c.out_type == DType::kFP32) {
    std::memcpy(static_cast<float*>(c.out) + size_t(t) * H, row, sizeof(float) * H);
  } else {
    uint16_t* o = static_cast<uint16_t*>(c.out) + size_t(t) * H;
    for (int i = 0; i < H; ++i) o[i] = float_to_bf16(row[i]);
  }
}

// 1: kTokensPerTask tokens into the kernels' input form.
void convert_task(const MoECallState& st, size_t task, int g) {
  const int chunk = int(task) * st.plan.groups + g;
  const int end = std::min(st.call.q, (chunk + 1) * kTokensPerTask);
  for (int t = chunk * kTokensPerTask; t < end; ++t) convert_token(st, t);
}

// 2: one 16-row block of one expert's rows; padding rows are zero so AMX tiles read defined data.
void gather_task(const MoECallState& st, size_t task, int g) {
  const long chunk = long(task) * st.plan.groups + g;
  const Routing& r = st.routing;
  if (chunk * kRowsPerTask >= r.total_rows) return;  // the groups' last round
  const long end = std::min(r.total_rows, (chunk + 1) * kRowsPerTask);
  if (st.tiled_block[chunk]) {
    st.rows.gather_tiled_block(st.tokens, &r.row_token[chunk * kRowsPerTask],
                               chunk * kRowsPerTask);
    return;
  }
  for (long row = chunk * kRowsPerTask; row < end; ++row) {
    const int tok = r.row_token[row];
    if (tok < 0) st.rows.zero(row, 0, st.rows.k, st.plan.group_size);
    else st.rows.copy_row(st.tokens, tok, row);
  }
}

// 4 by column blocks: down of one n-block of outputs over every expert, weighted into the
// group's partial. With one group the block is final: it goes to out here (store_in_down).
void down_cols_task(const MoECallState& st, size_t task, int g) {
  const CallPlan& p = st.plan;
  const Routing& r = st.routing;
  const int H = p.hidden, Hn = p.hidden_rows, nb0 = int(task), col0 = nb0 * kBlockN;
  const bool lead = p.format != WeightFormat::kINT8;
  const Epilogue& ep = p.epilogue();
  float* acc = st.accum[g];
  for (int t = 0; t < st.call.q; ++t) std::fill_n(acc + size_t(t) * Hn + col0, kBlockN, 0.0f);
  if (st.layer.slice(g) == 0) return;
  float* c = scratch(round_up(r.max_rows, 16) * kBlockN);
  for (size_t a = 0; a < r.experts.size(); ++a) {
    const int m = r.rows[a];
    const long row0 = r.first_row[a];
    if (lead && a + 1 < r.experts.size()) {
      const PackedMatrix& next = st.layer.down_of(g, r.experts[a + 1]);
      prefetch_start(next.n_block(nb0), next.n_block_bytes());
    }
    p.kernels_for(m).get(p.format)(st.layer.down_of(g, r.experts[a]),
                                   st.hidden[g].view(row0, m, p.tiled_rows(m)), nb0, nb0 + 1, c,
                                   kBlockN);
    for (int t = 0; t < m; ++t)
      ep.axpy(r.row_weight[row0 + t], c + t * kBlockN, kBlockN,
              acc + size_t(r.row_token[row0 + t]) * Hn + col0);
  }
  const int width = std::min(kBlockN, H - col0);  // the last n-block's padding rows stay here
  for (int t = 0; p.store_in_down && t < st.call.q; ++t)
    store_cols(st.call, H, t, col0, width, acc + size_t(t) * Hn + col0);
}

// 5 after a column down: the sum of the groups' partial outputs, written once in the output dtype.
void combine_groups_task(const MoECallState& st, size_t task, int g) {
  const int G = st.plan.groups, H = st.plan.hidden, Hn = st.plan.hidden_rows;
  const int chunk = int(task) * G + g;
  for (int t = chunk * kTokensPerTask; t < std::min(st.call.q, (chunk + 1) * kTokensPerTask);
       ++t) {
    float* row = st.accum[0] + size_t(t) * Hn;
    for (int gg = 1; gg < G; ++gg) {
      if (st.layer.slice(gg) == 0) continue;
      const float* part = st.accum[gg] + size_t(t) * Hn;
      for (int i = 0; i < H; ++i) row[i] += part[i];
    }
    store_row(st.call, H, t, row);
  }
}

// 5 after a down by row: each token's weighted rows over the NUMA groups, written once in the
// output dtype.
void combine_rows_task(const MoECallState& st, size_t task, int g) {
  const int G = st.plan.groups, H = st.plan.hidden, Hn = st.plan.hidden_rows;
  const int chunk = int(task) * G + g;
  const MoECall& c = st.call;
  const Routing& r = st.routing;
  float* row = scratch(H);
  for (int t = chunk * kTokensPerTask; t < std::min(c.q, (chunk + 1) * kTokensPerTask); ++t) {
    std::fill_n(row, H, 0.0f);
    for (int j = 0; j < c.k; ++j) {
      const long src = r.slot_row[size_t(t) * c.k + j];
      for (int gg = 0; gg < G && src >= 0; ++gg)
        if (st.layer.slice(gg) > 0)
          add_scaled(r.row_weight[src], st.row_out[gg] + size_t(src) * Hn, H, row);
    }
    store_row(c, H, t, row);
  }
}

}  // namespace

PhaseList prefill_job(const std::shared_ptr<MoECallState>& st) {
  const CallPlan& p = st->plan;
  PhaseList phases;
  phases.add(kConvert, p.convert_tasks, [st](size_t t, int g, int) { convert_task(*st, t, g); });
  phases.add(kGather, p.gather_tasks, [st](size_t t, int g, int) { gather_task(*st, t, g); });
  phases.add(kGateUp, p.gate_up_tasks, [st](size_t t, int g, int) { gate_up_task(*st, t, g); });
  if (p.by_row) {
    phases.add(kDown, p.down_tasks, [st](size_t t, int g, int) { down_rows_task(*st, t, g); });
    phases.add(kCombine, p.combine_tasks,
               [st](size_t t, int g, int) { combine_rows_task(*st, t, g); });
    return phases;
  }
  phases.add(kDown, p.down_tasks, [st](size_t t, int g, int) { down_cols_task(*st, t, g); });
  if (!p.store_in_down)
    phases.add(kCombine, p.combine_tasks,
               [st](size_t t, int g, int) { combine_groups_task(*st, t, g); });
  return phases;
}

}  // namespace hetmoe
