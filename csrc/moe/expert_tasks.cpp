// gate_up_task, down_rows_task and the per-row helpers (expert_tasks.h).
#include "moe/expert_tasks.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "layout/bf16.h"

namespace hetmoe {
namespace {

// Counts a decode gate/up task as done when it returns (also by an exception: a down task
// waiting for it must not spin forever; the job is reported failed anyway).
struct CountDone {
  std::atomic<int>* done;
  ~CountDone() {
    if (done) done->fetch_add(1, std::memory_order_release);
  }
};

// Decode: the gate/up input rows of active expert `a`. One row that no AMX tile reads is its
// token's row in place. Otherwise the first task to come copies the converted tokens into the
// expert's rows (and zeroes its padding rows if `pad`); the others spin until it is done (it is
// running on another worker and copies at most kDecodeMaxTokens rows, so the wait is short).
ActView decode_rows(MoECallState& st, size_t a, bool pad) {
  const Routing& r = st.routing;
  const long row0 = r.first_row[a];
  if (r.rows[a] == 1 && !pad) return st.tokens.view(r.row_token[row0], 1);
  std::atomic<int>& state = st.rows_state[a];
  int seen = state.load(std::memory_order_acquire);
  if (seen == 0 && state.compare_exchange_strong(seen, 1, std::memory_order_acq_rel)) {
    const long end = row0 + (pad ? long(round_up(r.rows[a], 16)) : r.rows[a]);
    for (long row = row0; row < end; ++row) {
      if (r.row_token[row] < 0) st.rows.zero(row, 0, st.rows.k, st.plan.group_size);
      else st.rows.copy_row(st.tokens, r.row_token[row], row);
    }
    state.store(2, std::memory_order_release);
  } else {
    while (state.load(std::memory_order_acquire) != 2) __builtin_ia32_pause();
  }
  return st.rows.view(row0, r.rows[a]);
}

// SiLU(gate) * up of expert a's rows (c: [rows][2 * cols], gate and up interleaved per n-block)
// into the hidden activations at col0; only AMX reads the padding rows, zeroed if `pad`.
void store_hidden(MoECallState& st, int g, size_t a, int col0, float* c, size_t ldc, bool pad,
                  bool tiled) {
  const CallPlan& p = st.plan;
  const Epilogue& ep = p.epilogue();
  const int m = st.routing.rows[a], mp = int(round_up(m, 16)), cols = p.cols;
  const long row0 = st.routing.first_row[a];
  float* h = c + size_t(mp) * ldc;  // scratch after c (gate_up_task)
  for (int t = 0; t < m; ++t) {
    ep.silu_mul(c + t * ldc, cols, h);
    st.hidden[g].put(ep, row0 + t, col0, h, cols, p.group_size, tiled);
  }
  for (int t = m; pad && t < mp; ++t) st.hidden[g].zero(row0 + t, col0, cols, p.group_size, tiled);
}

// Split groups: one part of a quantization group as fp32 values; the task that completes the
// group quantizes it into the hidden activations.
void store_hidden_part(MoECallState& st, int g, size_t a, int col0, const float* c, size_t ldc,
                       bool pad) {
  const CallPlan& p = st.plan;
  const Routing& r = st.routing;
  const Epilogue& ep = p.epilogue();
  const int m = r.rows[a], mp = int(round_up(m, 16)), gs = p.group_size;
  const long row0 = r.first_row[a];
  const size_t ld = size_t(st.layer.slice(g)), grp = size_t(col0 / gs), gcol = grp * gs;
  float* hf = st.hidden_float[g];
  for (int t = 0; t < m; ++t) ep.silu_mul(c + t * ldc, p.cols, hf + (row0 + t) * ld + col0);
  std::atomic<int>& done = st.parts_done[(g * r.experts.size() + a) * p.max_groups + grp];
  if (done.fetch_add(1, std::memory_order_acq_rel) + 1 < p.parts) return;
  for (int t = 0; t < m; ++t)
    st.hidden[g].put(ep, row0 + t, gcol, hf + (row0 + t) * ld + gcol, gs, gs);
  for (int t = m; pad && t < mp; ++t) st.hidden[g].zero(row0 + t, gcol, gs, gs);
}

}  // namespace

float* scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

void convert_token(const MoECallState& st, int t) {
  const MoECall& c = st.call;
  const int H = st.plan.hidden, Hp = st.plan.hidden_padded;
  float* row = scratch(Hp);
  if (c.x_type == DType::kBF16) {
    const uint16_t* x = static_cast<const uint16_t*>(c.x) + size_t(t) * H;
    for (int i = 0; i < H; ++i) row[i] = bf16_to_float(x[i]);  // one loop per dtype: vectorized
  } else {
    std::memcpy(row, static_cast<const float*>(c.x) + size_t(t) * H, sizeof(float) * H);
  }
  std::fill(row + H, row + Hp, 0.0f);
  st.tokens.put(st.plan.epilogue(), t, 0, row, Hp, st.plan.group_size);
}

void store_cols(const MoECall& c, int H, int t, int col0, int n, const float* row) {
  if (c.out_type == DType::kFP32) {
    std::memcpy(static_cast<float*>(c.out) + size_t(t) * H + col0, row, sizeof(float) * n);
  } else {
    uint16_t* o = static_cast<uint16_t*>(c.out) + size_t(t) * H + col0;
    for (int i = 0; i < n; ++i) o[i] = float_to_bf16(row[i]);
  }
}

void gate_up_task(MoECallState& st, size_t task, int g) {
  const CallPlan& p = st.plan;
  const Routing& r = st.routing;
  const int per_expert = st.layer.slice(g) / p.cols;
  if (per_expert == 0 || task >= r.experts.size() * per_expert) return;
  const size_t a = task / per_expert;
  const CountDone count{p.decode() ? &st.gate_up_done[g * st.expert_stride + a] : nullptr};
  const int col0 = int(task % per_expert) * p.cols, m = r.rows[a], mp = int(round_up(m, 16));
  const bool pad = p.amx_rows(m), tiled = p.tiled_rows(m);
  const ActView rows = p.decode() ? decode_rows(st, a, pad)
                                  : st.rows.view(r.first_row[a], m, tiled);
  const size_t ldc = 2 * size_t(p.cols);
  float* c = scratch(size_t(mp) * ldc + p.cols);
  p.kernels_for(m).get(p.format)(st.layer.gate_up_of(g, r.experts[a]), rows, 2 * col0 / kBlockN,
                                 2 * (col0 + p.cols) / kBlockN, c, ldc);
  if (p.parts > 1) store_hidden_part(st, g, a, col0, c, ldc, pad);
  else store_hidden(st, g, a, col0, c, ldc, pad, tiled);
}

void down_rows_task(MoECallState& st, size_t task, int g) {
  const CallPlan& p = st.plan;
  const Routing& r = st.routing;
  // A planned decode job has tasks for fewer experts once bound (bind_plan).
  if (st.layer.slice(g) == 0 || task >= r.experts.size() * p.down_per_expert) return;
  const size_t a = task / p.down_per_expert;
  if (p.decode()) {  // the expert's hidden activations: its gate/up tasks (all claimed before)
    const std::atomic<int>& done = st.gate_up_done[g * st.expert_stride + a];
    while (done.load(std::memory_order_acquire) < st.layer.slice(g) / p.cols)
      __builtin_ia32_pause();
  }
  const int Hn = p.hidden_rows, nbs = Hn / kBlockN;
  const int nb0 = int(task % p.down_per_expert) * p.down_run, nb1 = std::min(nbs, nb0 + p.down_run);
  const int m = r.rows[a];
  const long row0 = r.first_row[a];
  ActView hidden = st.hidden[g].view(row0, m, p.tiled_rows(m));
  hidden.stream_c = !p.decode();  // the combine phase reads them, after every down task
  p.kernels_for(m).get(p.format)(st.layer.down_of(g, r.experts[a]), hidden, nb0, nb1,
                                 st.row_out[g] + size_t(row0) * Hn + nb0 * kBlockN, Hn);
}

}  // namespace hetmoe
