// make_call_state: a call's workspace views, decode token buffer and counters (call_state.h).
#include "moe/call_state.h"

#include <algorithm>
#include <new>

namespace hetmoe {
namespace {

std::unique_ptr<std::atomic<int>[]> zeroed_counters(size_t n) {
  std::unique_ptr<std::atomic<int>[]> counters(new std::atomic<int>[n]);
  for (size_t i = 0; i < n; ++i) counters[i].store(0, std::memory_order_relaxed);
  return counters;
}

// Views of the shared workspace: tokens and rows, then per NUMA group its hidden activations
// and the outputs its down tasks write.
void view_workspace(MoECallState& st) {
  const CallPlan& p = st.plan;
  const size_t Hp = size_t(p.hidden_padded), R = p.rows, ngx = p.token_groups, elem = p.elem;
  const bool quantized = u8_activations(p.format);
  st.ws = acquire_workspace(p.workspace);
  const Workspace& ws = *st.ws;
  st.tokens = {ws.at<uint8_t>(kTokenAct), ws.at<float>(kTokenGroups), Hp, size_t(p.q), ngx, elem};
  st.rows = {ws.at<uint8_t>(kRowAct), ws.at<float>(kRowGroups), Hp, R, ngx, elem};
  size_t h_off = 0, hg_off = 0, hf_off = 0;
  for (int g = 0; g < p.groups; ++g) {
    const size_t ig = size_t(st.layer.slice(g)), ngh = quantized ? ig / p.group_size : 0;
    st.hidden.push_back({ws.at<uint8_t>(kHidden, h_off), ws.at<float>(kHiddenGroups, hg_off), ig,
                         R, ngh, elem});
    st.hidden_float.push_back(p.split_groups ? ws.at<float>(kHiddenFloat, R * hf_off * 4)
                                             : nullptr);
    hf_off += ig;
    st.accum.push_back(p.by_row ? nullptr
                                : ws.at<float>(kAccum, size_t(g) * p.q * p.hidden_rows * 4));
    st.row_out.push_back(p.by_row ? ws.at<float>(kRowOut, size_t(g) * R * p.hidden_rows * 4)
                                  : nullptr);
    h_off += R * ig * elem;
    hg_off += 3 * R * ngh * 4;
  }
}

// Prefill: which 16-row blocks hold an AMX expert's rows in tile order.
void mark_tiled_blocks(MoECallState& st) {
  const Routing& r = st.routing;
  st.tiled_block.assign(st.plan.rows / 16, 0);
  for (size_t a = 0; a < r.experts.size(); ++a)
    std::fill_n(st.tiled_block.begin() + r.first_row[a] / 16, round_up(r.rows[a], 16) / 16,
                uint8_t(st.plan.tiled_rows(r.rows[a])));
}

// Decode: the call's own token buffer (in place of the workspace's) and its task counters.
void decode_buffers(MoECallState& st) {
  const CallPlan& p = st.plan;
  const size_t q = size_t(p.q), experts = st.routing.experts.size();
  const size_t act_bytes = round_up(q * p.hidden_padded * p.elem, 64);
  st.token_buf.reset(static_cast<uint8_t*>(
      std::aligned_alloc(64, act_bytes + round_up(3 * q * p.token_groups * 4, 64))));
  if (!st.token_buf) throw std::bad_alloc();
  st.tokens.act = st.token_buf.get();
  st.tokens.groups = reinterpret_cast<float*>(st.token_buf.get() + act_bytes);
  st.rows_state = zeroed_counters(experts);
  if (p.split_groups) st.parts_done = zeroed_counters(size_t(p.groups) * experts * p.max_groups);
  st.expert_stride = experts;
  st.gate_up_done = zeroed_counters(size_t(p.groups) * experts);
}

}  // namespace

std::shared_ptr<MoECallState> make_call_state(const MoECall& call, Routing routing,
                                              const CallPlan& plan, const LayerRef& layer) {
  auto st = std::make_shared<MoECallState>();
  st->call = call;
  st->routing = std::move(routing);
  st->plan = plan;
  st->layer = layer;
  view_workspace(*st);
  if (plan.decode()) decode_buffers(*st);
  else mark_tiled_blocks(*st);
  return st;
}

}  // namespace hetmoe
