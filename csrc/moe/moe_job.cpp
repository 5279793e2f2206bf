// The forward job of MoELayer: phases of one MoE call on the pool.
//   1 tokens -> kernel input form      2 gather rows per expert (16-row aligned)
//   3 gate/up + SiLU (expert, block)   4 down + weighted sum (output column blocks, all experts)
//   5 sum of the NUMA groups' partial outputs -> out
// Prefill (experts with >= kRowsForRowOut rows) instead runs 4 as (expert, column block) tasks
// writing each row's down output, and 5 sums every token's weighted rows: each task then reads
// its expert's activations once instead of every task reading all experts' (from L3).
// Phases 3 and 4 run in every NUMA group over its own intermediate slice; the others split their
// tasks across groups.
// Decode (q <= kFoldTokens) folds 1 and 2 into 3: the q tokens are converted when the job is
// made (a flag-gated job: when its ready word is seen, the rest of the job made before it), an
// expert with one row reads its token's row in place, and the first gate/up task of an expert
// with more rows gathers them while the expert's other tasks wait for it. Its 4 runs as (expert,
// run of n-blocks) tasks, each streaming one run of one expert's weights into the rows' outputs,
// and 5 sums them per (token, column chunk) in expert order. 3 and 4 are one phase: its tasks are
// every gate/up task, then every down task, claimed in that order, and a down task waits for its
// expert's gate/up tasks (long done, but for the last experts'), so no core idles at a barrier
// between them: a q=1 call is 2 phases. Padding rows
// (to 16 per expert) are written only for experts whose kernels are AMX tiles, the only ones
// that read them.
// Otherwise (prefill), the rows and hidden activations of experts on AMX tiles are written in tile
// order (act_store.h) by the gather and the gate/up epilogue, and every AMX task reads its A tiles
// in place instead of copying its expert's rows again.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/gemm.h"
#include "layout/bf16.h"
#include "moe/act_store.h"
#include "moe/moe_layer.h"
#include "moe/routing.h"
#include "moe/workspace.h"

namespace hetmoe {

struct MoECallState {
  MoECall call;
  Routing routing;
  std::shared_ptr<Workspace> ws;
  ActStore tokens, rows;
  std::vector<ActStore> hidden;  // per NUMA group
  std::vector<float*> accum;     // per NUMA group, [q][H]
  std::vector<float*> row_out;   // per NUMA group, [rows][H] (prefill)
  // Prefill: per 16-row block of the rows, nonzero = its expert's rows are in tile order.
  std::vector<uint8_t> tiled_block;
  // Decode: per active expert 0 = rows not gathered, 1 = being gathered, 2 = ready.
  std::unique_ptr<std::atomic<int>[]> rows_state;
  // Decode: the converted tokens, owned by the call (they are written when the job is made,
  // while earlier jobs may still be using the shared workspace).
  std::unique_ptr<uint8_t, decltype(&std::free)> token_buf{nullptr, &std::free};
  // Decode with groups wider than MoEConfig::decode_cols: per NUMA group [rows][Ig] fp32 hidden
  // values, and per (NUMA group, active expert, hidden group) the tasks that have written their
  // part.
  std::vector<float*> hidden_float;
  std::unique_ptr<std::atomic<int>[]> parts_done;
  // Decode: per (NUMA group, active expert) the gate/up tasks done, which the expert's down tasks
  // wait for (gate/up and down are one phase: no barrier between them); `expert_stride` = the
  // active experts the job was made for.
  std::unique_ptr<std::atomic<int>[]> gate_up_done;
  size_t expert_stride = 0;
  // A planned job (see MoELayer::make_job): its gate/up phase and columns per task.
  size_t gate_up_phase = 0;
  int cols = 0;
  size_t down_phase = 0;  // and its tasks per expert (decode)
  int down_per_expert = 0;
  // Decode: tasks [0, gate_up_tasks) of the merged phase are gate/up, the rest down.
  size_t gate_up_tasks = 0;
};

namespace {

constexpr int kTokensPerTask = 4;
constexpr int kRowsPerTask = 16;     // one 16-row block per gather task (blocks are tiled whole)
constexpr int kRowsForRowOut = 32;   // max rows per expert from which phase 4 goes by expert
constexpr int kRowOutBlocks = 16;    // n-blocks (256 outputs) per (expert, column block) task
constexpr int kFoldTokens = 4;       // max q whose rows are converted inside the gate/up phase
constexpr int kCombineCols = 256;    // output columns per decode combine task
// The AVX-512 bf16 / int4 kernels prefetch every line this far ahead within one call; a decode
// down task calls them on one short n-block per expert, so it fetches the start of the next
// expert's while the current one runs.
constexpr size_t kLeadBytes = 4096;
// Slots of phase_us(): convert, gather, gate/up, down, combine (folded phases report 0); a
// decode's merged phase reports its gate/up and down tasks in their slots.
enum PhaseSlot { kConvert, kGather, kGateUp, kDown, kCombine, kNumSlots, kGateUpDown = kNumSlots };

using PhaseFn = decltype(Phase::fn);

const IsaKernels& kernels_of(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return amx_kernels();
    case Isa::kAvx512: return avx512_kernels();
    case Isa::kAvx2: return avx2_kernels();
    default: return reference_kernels();
  }
}

float* scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

// Token t of x in the kernels' input form (zero-padded to Hp) into row t of `dst`.
void convert_token(const MoECall& c, const ActStore& dst, const Epilogue& ep, int H, int Hp,
                   int gs, int t) {
  float* row = scratch(Hp);
  if (c.x_type == DType::kBF16) {
    const uint16_t* x = static_cast<const uint16_t*>(c.x) + size_t(t) * H;
    for (int i = 0; i < H; ++i) row[i] = bf16_to_float(x[i]);  // one loop per dtype: vectorized
  } else {
    std::memcpy(row, static_cast<const float*>(c.x) + size_t(t) * H, sizeof(float) * H);
  }
  std::fill(row + H, row + Hp, 0.0f);
  dst.put(ep, t, 0, row, Hp, gs);
}


// Decode: the gate/up input rows of active expert `a`. One row that no AMX tile reads is its
// token's row in place. Otherwise the first task to come copies the converted tokens into the
// expert's rows (and zeroes its padding rows if `pad`); the others spin until it is done (it is
// running on another worker and copies at most kFoldTokens rows, so the wait is short).
ActView decode_rows(MoECallState& st, int gs, size_t a, bool pad) {
  const Routing& r = st.routing;
  const long row0 = r.first_row[a];
  if (r.rows[a] == 1 && !pad) return st.tokens.view(r.row_token[row0], 1);
  std::atomic<int>& state = st.rows_state[a];
  int seen = state.load(std::memory_order_acquire);
  if (seen == 0 && state.compare_exchange_strong(seen, 1, std::memory_order_acq_rel)) {
    const long end = row0 + (pad ? long(round_up(r.rows[a], 16)) : r.rows[a]);
    for (long row = row0; row < end; ++row) {
      if (r.row_token[row] < 0) st.rows.zero(row, 0, st.rows.k, gs);
      else st.rows.copy_row(st.tokens, r.row_token[row], row);
    }
    state.store(2, std::memory_order_release);
  } else {
    while (state.load(std::memory_order_acquire) != 2) __builtin_ia32_pause();
  }
  return st.rows.view(row0, r.rows[a]);
}

// out[t, col0:col0+n] = row[0:n] in the call's output dtype.
void store_cols(const MoECall& c, int H, int t, int col0, int n, const float* row) {
  if (c.out_type == DType::kFP32) {
    std::memcpy(static_cast<float*>(c.out) + size_t(t) * H + col0, row, sizeof(float) * n);
  } else {
    uint16_t* o = static_cast<uint16_t*>(c.out) + size_t(t) * H + col0;
    for (int i = 0; i < n; ++i) o[i] = float_to_bf16(row[i]);
  }
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

// dst[j] += w * src[j] (the compiler vectorizes it for the baseline ISA of this file).
void add_scaled(float w, const float* __restrict src, int n, float* __restrict dst) {
  for (int j = 0; j < n; ++j) dst[j] += w * src[j];
}

void prefetch_start(const uint8_t* p, size_t bytes) {
  for (size_t i = 0; i < std::min(bytes, kLeadBytes); i += 64) __builtin_prefetch(p + i, 0, 3);
}

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

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

struct PhaseClock {
  explicit PhaseClock(size_t n)
      : first(new std::atomic<int64_t>[n]), last(new std::atomic<int64_t>[n]), size(n) {
    for (size_t i = 0; i < n; ++i) first[i] = INT64_MAX, last[i] = 0;
  }
  std::unique_ptr<std::atomic<int64_t>[]> first, last;
  size_t size;
  // See MoELayer::take_timeline.
  int64_t start = 0, built = 0, done = 0, picked = 0, made = 0, claimed = 0;
};

namespace {
// Profiled calls kept per layer until take_timeline() (about 1 MB); later ones are not kept.
constexpr size_t kTimelineCalls = 4096;
}  // namespace

std::vector<std::vector<int64_t>> MoELayer::take_timeline() {
  std::vector<std::vector<int64_t>> rows;
  for (const auto& clock : timeline_) {
    std::vector<int64_t> row{clock->start, clock->built, clock->done};
    int64_t last_end = 0;
    for (size_t i = 0; i < clock->size; ++i) {
      const bool ran = clock->last[i] > 0;
      row.push_back(ran ? clock->first[i].load() : 0);
      row.push_back(ran ? clock->last[i].load() : 0);
      last_end = std::max(last_end, row.back());
    }
    if (row[2] == 0) row[2] = last_end;  // submit(): done when its last task ended
    row.push_back(clock->picked);
    row.push_back(clock->made);
    row.push_back(clock->claimed);
    rows.push_back(std::move(row));
  }
  timeline_.clear();
  return rows;
}

// One flagged job's parts (the immediate slots, then with deferral the deferred ones), handed
// from its prepare step to its build and finish steps (MoELayer::submit_flagged).
struct FlaggedParts {
  std::vector<MoECall> calls;
  std::vector<StreamFlags*> done;
  std::vector<std::shared_ptr<MoECallState>> planned;  // decode parts made before the ready word
  std::vector<Job> jobs;
  std::vector<std::shared_ptr<PhaseClock>> clocks;  // when profiling
  std::exception_ptr failed;  // of the prepare: reported once the ready word is consumed
  std::atomic<size_t> signalled{0};  // parts whose done word is set
  int64_t picked = 0, made = 0;
};

JobHandle MoELayer::submit_flagged(StreamFlags& flags, int deferred, StreamFlags* late_flags,
                                   void* late_out) {
  auto fp = std::make_shared<FlaggedParts>();
  fp->calls = {bound_call_};
  fp->done = {&flags};
  if (deferred != 0) {
    const MoECall& c = bound_call_;
    if (deferred < 0 || deferred >= c.k)
      throw std::invalid_argument("submit_flagged: deferred must be in [0, k = " +
                                  std::to_string(c.k) + "), got " + std::to_string(deferred));
    if (late_flags == nullptr || late_out == nullptr)
      throw std::invalid_argument("submit_flagged: deferred experts need late_flags and late_out");
    fp->calls[0].end_slot = c.k - deferred;
    fp->calls.push_back(c);
    fp->calls[1].first_slot = c.k - deferred;
    fp->calls[1].out = late_out;
    fp->done.push_back(late_flags);
  }
  const size_t n = fp->calls.size();
  fp->planned.resize(n);
  fp->jobs.resize(n);
  return pool_.submit_built(
      // build: once the ready word is set, route and convert, then hand the phases over.
      [this, fp, &flags, n] {
        const int64_t claimed = profile_ ? now_ns() : 0;
        if (!flags.wait_ready()) return Job{};
        if (fp->failed) std::rethrow_exception(fp->failed);
        const int64_t ready = profile_ ? now_ns() : 0;
        for (size_t p = 0; p < n; ++p) {
          if (fp->planned[p]) continue;
          fp->jobs[p] = make_job(fp->calls[p]);  // not a decode call: made now
          if (profile_) fp->clocks.push_back(last_clock_);
        }
        if (fp->planned[0]) bind_job(&fp->jobs[0], *fp->planned[0]);
        if (profile_) {
          PhaseClock& first = *fp->clocks.front();
          first.start = ready, first.built = now_ns();
          first.picked = fp->picked, first.made = fp->made;
          first.claimed = claimed;
        }
        Job job = std::move(fp->jobs[0]);
        if (n == 1) return job;
        if (fp->planned[1]) {
          // The deferred part is routed by one more task of the immediate part's last phase (a
          // decode combine leaves most workers idle); its phases keep their planned task counts,
          // whose tasks beyond the routed experts return at once.
          Phase& last = job.back();
          const size_t extra = last.num_tasks;
          last.num_tasks += 1;
          last.fn = [this, fp, extra, inner = std::move(last.fn)](size_t task, int g, int w) {
            if (task < extra) inner(task, g, w);
            else if (g == 0) bind_job(nullptr, *fp->planned[1]);
          };
        }
        // The immediate part's done word, then straight on to the deferred part.
        job.push_back({1, [this, fp](size_t, int g, int) {
          if (g != 0) return;
          if (profile_) {
            const int64_t t = now_ns();
            fp->clocks[0]->done = t;
            fp->clocks[1]->start = fp->clocks[1]->built = t;
          }
          fp->done[0]->signal_done();
          fp->signalled.store(1, std::memory_order_release);
        }});
        for (Phase& phase : fp->jobs[1]) job.push_back(std::move(phase));
        return job;
      },
      // finish: runs before any later job of the pool starts, also after a failure: every done
      // word not set yet is set, so the stream never waits for a part that will not run.
      [this, fp, n] {
        const int64_t t = profile_ ? now_ns() : 0;
        for (size_t p = fp->signalled.load(std::memory_order_acquire); p < n; ++p) {
          if (p < fp->clocks.size()) fp->clocks[p]->done = t;
          fp->done[p]->signal_done();
        }
      },
      // prepare: a decode call's job is made while earlier jobs run and the GPU still computes
      // its inputs; only the routing and the token conversion wait for the ready word.
      [this, fp, n] {
        fp->picked = profile_ ? now_ns() : 0;
        try {
          for (size_t p = 0; p < n && fp->calls[p].q <= kFoldTokens; ++p) {
            fp->jobs[p] = make_job(fp->calls[p], &fp->planned[p]);
            if (profile_) fp->clocks.push_back(last_clock_);
          }
        } catch (...) {
          fp->failed = std::current_exception();
        }
        fp->made = profile_ ? now_ns() : 0;
      });
}

std::vector<double> MoELayer::phase_us() const {
  std::vector<double> us;
  for (size_t i = 0; last_clock_ && i < last_clock_->size; ++i)
    us.push_back(last_clock_->last[i] > 0
                     ? double(last_clock_->last[i] - last_clock_->first[i]) / 1e3
                     : 0.0);
  return us;
}

Job MoELayer::make_job(const MoECall& call, std::shared_ptr<MoECallState>* planned) const {
  auto st = std::make_shared<MoECallState>();
  st->call = call;
  if (planned) {
    // The ids are not written yet: size the job for the most experts a decode call can reach,
    // each padded to 16 rows; bind_job routes it once they are.
    const int slots = (call.end_slot < 0 ? call.k : call.end_slot) - call.first_slot;
    const int most = std::min(call.q * slots, cfg_.num_experts);
    st->routing.experts.assign(most, 0);
    st->routing.total_rows = 16L * most;
    st->routing.max_rows = call.q;
  } else {
    st->routing = route(call.ids, call.weights, call.q, call.k, cfg_.num_experts, gpu_mask_,
                        loaded_, call.first_slot, call.end_slot);
  }
  const Routing& rt = st->routing;
  const int G = num_groups(), H = cfg_.hidden, Hp = hidden_padded_, q = call.q;
  const bool quantized = cfg_.format != WeightFormat::kBF16;
  const int gs = cfg_.group_size;
  const size_t elem = quantized ? 1 : 2, R = size_t(rt.total_rows);
  const size_t ngx = quantized ? Hp / gs : 0, Ip = slice_begin_.back();
  std::array<size_t, kNumRegions> need{};
  need[kTokenAct] = size_t(q) * Hp * elem;
  need[kTokenGroups] = 3 * size_t(q) * ngx * 4;
  need[kRowAct] = R * Hp * elem;
  need[kRowGroups] = 3 * R * ngx * 4;
  need[kHidden] = R * Ip * elem;
  need[kHiddenGroups] = quantized ? 3 * R * (Ip / gs) * 4 : 0;
  const bool row_out = rt.max_rows >= kRowsForRowOut;
  const bool fold = q <= kFoldTokens && !row_out, store_in_down = G == 1 && !row_out;
  // Decode tasks narrower than a group write fp32 values; the last part quantizes the group.
  const bool split_groups = fold && gs > cfg_.decode_cols;
  // Decode also writes each row's down output, in runs of n-blocks per expert (long streams of
  // one expert's weights), then sums them per token.
  const bool by_row = row_out || fold;
  need[kAccum] = by_row ? 0 : size_t(G) * q * H * 4;
  need[kRowOut] = by_row ? size_t(G) * R * H * 4 : 0;
  need[kHiddenFloat] = split_groups ? R * Ip * 4 : 0;
  st->ws = acquire_workspace(need);
  const Workspace& ws = *st->ws;
  st->tokens = {ws.at<uint8_t>(kTokenAct), ws.at<float>(kTokenGroups), size_t(Hp), size_t(q),
                ngx, elem};
  st->rows = {ws.at<uint8_t>(kRowAct), ws.at<float>(kRowGroups), size_t(Hp), R, ngx, elem};
  size_t h_off = 0, hg_off = 0, hf_off = 0;
  for (int g = 0; g < G; ++g) {
    const size_t ig = size_t(slice(g)), ngh = quantized ? ig / gs : 0;
    st->hidden.push_back({ws.at<uint8_t>(kHidden, h_off), ws.at<float>(kHiddenGroups, hg_off), ig,
                          R, ngh, elem});
    st->hidden_float.push_back(split_groups ? ws.at<float>(kHiddenFloat, R * hf_off * 4)
                                            : nullptr);
    hf_off += ig;
    st->accum.push_back(by_row ? nullptr : ws.at<float>(kAccum, size_t(g) * q * H * 4));
    st->row_out.push_back(by_row ? ws.at<float>(kRowOut, size_t(g) * R * H * 4) : nullptr);
    h_off += R * ig * elem;
    hg_off += 3 * R * ngh * 4;
  }

  auto split = [G](int total) { return size_t((total + G - 1) / G); };
  const int token_tasks = (q + kTokensPerTask - 1) / kTokensPerTask;
  const int row_tasks = int(R / kRowsPerTask);
  const Isa small_isa = std::min(cfg_.max_isa, Isa::kAvx512);
  // AMX for experts with m rows; only AMX tiles read an expert's padding rows (to 16).
  auto amx_for = [max_isa = cfg_.max_isa, amx_min = cfg_.amx_min_tokens](int m) {
    return max_isa == Isa::kAmx && m >= amx_min;
  };
  auto kernels_for = [amx_for, small_isa](int m) -> const IsaKernels& {
    return kernels_of(amx_for(m) ? Isa::kAmx : small_isa);
  };
  // Prefill rows and hidden activations of AMX experts are kept in tile order.
  auto tiled_for = [amx_for, fold](int m) { return !fold && amx_for(m); };
  if (!fold) {
    st->tiled_block.assign(R / 16, 0);
    for (size_t a = 0; a < rt.experts.size(); ++a)
      std::fill_n(st->tiled_block.begin() + rt.first_row[a] / 16, round_up(rt.rows[a], 16) / 16,
                  uint8_t(tiled_for(rt.rows[a])));
  }
  Job job;
  std::vector<int> slots;  // the PhaseSlot of each phase of `job`
  const Epilogue* ep = &kernels_of(small_isa).epilogue;
  if (fold) {
    // The few tokens are converted here, before the pool starts (a microsecond or two each).
    const size_t act_bytes = round_up(size_t(q) * Hp * elem, 64);
    st->token_buf.reset(static_cast<uint8_t*>(
        std::aligned_alloc(64, act_bytes + round_up(3 * size_t(q) * ngx * 4, 64))));
    if (!st->token_buf) throw std::bad_alloc();
    st->tokens.act = st->token_buf.get();
    st->tokens.groups = reinterpret_cast<float*>(st->token_buf.get() + act_bytes);
    for (int t = 0; !planned && t < q; ++t) convert_token(call, st->tokens, *ep, H, Hp, gs, t);
    st->rows_state.reset(new std::atomic<int>[rt.experts.size()]);
    for (size_t a = 0; a < rt.experts.size(); ++a) st->rows_state[a].store(0);
  } else {
    // 1: each token once into the kernels' input form.
    slots.push_back(kConvert);
    job.push_back({split(token_tasks), [st, G, H, Hp, gs, ep](size_t task, int g, int) {
      const int chunk = int(task) * G + g;
      const int end = std::min(st->call.q, (chunk + 1) * kTokensPerTask);
      for (int t = chunk * kTokensPerTask; t < end; ++t)
        convert_token(st->call, st->tokens, *ep, H, Hp, gs, t);
    }});
    // 2: rows grouped by expert (a task: one 16-row block of one expert); padding rows are zero
    // so AMX tiles read defined data.
    slots.push_back(kGather);
    job.push_back({split(row_tasks), [st, G, gs](size_t task, int g, int) {
      const long chunk = long(task) * G + g;
      if (chunk * kRowsPerTask >= st->routing.total_rows) return;  // the groups' last round
      const long end = std::min(st->routing.total_rows, (chunk + 1) * kRowsPerTask);
      if (st->tiled_block[chunk]) {
        st->rows.gather_tiled_block(st->tokens, &st->routing.row_token[chunk * kRowsPerTask],
                                    chunk * kRowsPerTask);
        return;
      }
      for (long r = chunk * kRowsPerTask; r < end; ++r) {
        const int tok = st->routing.row_token[r];
        if (tok < 0) st->rows.zero(r, 0, st->rows.k, gs);
        else st->rows.copy_row(st->tokens, tok, r);
      }
    }});
  }
  // 3: gate and up of one block of intermediate columns, SiLU(gate) * up -> hidden activations.
  // Whole quantization groups per task; 32 columns for decode (many tasks balance the cores),
  // up to 128 (256 from 32 rows) for prefill (each task re-reads its expert's rows: fewer, wider
  // tasks).
  int cols = std::max(2 * kBlockN, gs);
  auto divides_slices = [this, G](int c) {
    for (int g = 0; g < G; ++g)
      if (slice(g) % c) return false;
    return true;
  };
  const int max_cols = row_out ? 256 : 128;
  while (rt.max_rows >= 16 && cols < max_cols && divides_slices(2 * cols)) cols *= 2;
  // Decode with a group wider than decode_cols (int8 128, say: 6 tasks of 512 KB per expert)
  // would leave few, long tasks for the cores; such groups are split into parts of decode_cols.
  if (split_groups) cols = cfg_.decode_cols;
  const int parts = split_groups ? gs / cols : 1;
  size_t max_groups = 0;
  std::vector<size_t> gu_tasks(G);
  for (int g = 0; g < G; ++g) {
    gu_tasks[g] = rt.experts.size() * (slice(g) / cols);
    if (gs) max_groups = std::max(max_groups, size_t(slice(g) / gs));
  }
  if (split_groups) {
    const size_t counters = size_t(G) * rt.experts.size() * max_groups;
    st->parts_done.reset(new std::atomic<int>[counters]);
    for (size_t i = 0; i < counters; ++i) st->parts_done[i].store(0, std::memory_order_relaxed);
  }
  const size_t gu_max = G ? *std::max_element(gu_tasks.begin(), gu_tasks.end()) : 0;
  st->gate_up_phase = job.size();
  st->cols = cols;
  st->gate_up_tasks = gu_max;
  const bool merged = fold;
  if (merged) {
    st->expert_stride = rt.experts.size();
    st->gate_up_done.reset(new std::atomic<int>[size_t(G) * st->expert_stride]);
    for (size_t i = 0; i < size_t(G) * st->expert_stride; ++i)
      st->gate_up_done[i].store(0, std::memory_order_relaxed);
  }
  // Counts a decode gate/up task as done when it returns (also by an exception: a down task
  // waiting for it must not spin forever; the job is reported failed anyway).
  struct CountDone {
    std::atomic<int>* done;
    ~CountDone() {
      if (done) done->fetch_add(1, std::memory_order_release);
    }
  };
  PhaseFn gate_up = [this, st, cols, gs, kernels_for, amx_for, tiled_for, ep, fold, merged,
                     parts, max_groups](size_t task, int g, int) {
    const int per_expert = slice(g) / cols;
    if (per_expert == 0 || task >= st->routing.experts.size() * per_expert) return;
    const Routing& r = st->routing;
    const size_t a = task / per_expert;
    const CountDone count{merged ? &st->gate_up_done[g * st->expert_stride + a] : nullptr};
    const int col0 = int(task % per_expert) * cols, m = r.rows[a], mp = int(round_up(m, 16));
    const long row0 = r.first_row[a];
    const bool pad = amx_for(m), tiled = tiled_for(m);
    const ActView rows = fold ? decode_rows(*st, gs, a, pad) : st->rows.view(row0, m, tiled);
    const PackedMatrix& w = gate_up_[size_t(g) * cfg_.num_experts + r.experts[a]];
    const size_t ldc = 2 * size_t(cols);
    float* c = scratch(size_t(mp) * ldc + cols);
    float* h = c + size_t(mp) * ldc;
    kernels_for(m).get(cfg_.format)(w, rows, 2 * col0 / kBlockN, 2 * (col0 + cols) / kBlockN, c,
                                    ldc);
    if (parts > 1) {
      // One part of a group: fp32 values out; the task that completes the group quantizes it.
      const size_t ld = size_t(slice(g)), grp = size_t(col0 / gs), gcol = grp * gs;
      float* hf = st->hidden_float[g];
      for (int t = 0; t < m; ++t) ep->silu_mul(c + t * ldc, cols, hf + (row0 + t) * ld + col0);
      std::atomic<int>& done = st->parts_done[(g * r.experts.size() + a) * max_groups + grp];
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 < parts) return;
      for (int t = 0; t < m; ++t)
        st->hidden[g].put(*ep, row0 + t, gcol, hf + (row0 + t) * ld + gcol, gs, gs);
      for (int t = m; pad && t < mp; ++t) st->hidden[g].zero(row0 + t, gcol, gs, gs);
      return;
    }
    for (int t = 0; t < m; ++t) {
      ep->silu_mul(c + t * ldc, cols, h);
      st->hidden[g].put(*ep, row0 + t, col0, h, cols, gs, tiled);
    }
    // The down kernel for m rows is the same family: only AMX reads the padding rows.
    for (int t = m; pad && t < mp; ++t) st->hidden[g].zero(row0 + t, col0, cols, gs, tiled);
  };
  if (!merged) {
    slots.push_back(kGateUp);
    job.push_back({gu_max, std::move(gate_up)});
  }
  if (by_row) {
    // 4: down of (expert, run of n-blocks) straight into the rows' outputs: each task streams one
    // run of one expert's weights. Prefill runs are 16 n-blocks (256 outputs); decode runs are as
    // long as leaves the phase's last round of tasks little idle (down_run_blocks).
    const int nbs = H / kBlockN;
    const int run = fold ? down_run_blocks(rt.experts.size(), nbs, pool_.group_size(0))
                         : kRowOutBlocks;
    const int per_expert = (nbs + run - 1) / run;
    st->down_phase = job.size();
    st->down_per_expert = per_expert;
    PhaseFn down = [this, st, nbs, run, per_expert, H, cols, merged, kernels_for,
                    tiled_for](size_t task, int g, int) {
      const Routing& r = st->routing;
      // A planned decode job has tasks for fewer experts once bound (bind_job).
      if (slice(g) == 0 || task >= r.experts.size() * per_expert) return;
      const size_t a = task / per_expert;
      if (merged) {  // the expert's hidden activations: its gate/up tasks (all claimed before)
        const std::atomic<int>& done = st->gate_up_done[g * st->expert_stride + a];
        while (done.load(std::memory_order_acquire) < slice(g) / cols) __builtin_ia32_pause();
      }
      const int nb0 = int(task % per_expert) * run, nb1 = std::min(nbs, nb0 + run);
      const int m = r.rows[a];
      const long row0 = r.first_row[a];
      const PackedMatrix& w = down_[size_t(g) * cfg_.num_experts + r.experts[a]];
      kernels_for(m).get(cfg_.format)(w, st->hidden[g].view(row0, m, tiled_for(m)), nb0, nb1,
                                      st->row_out[g] + size_t(row0) * H + nb0 * kBlockN, H);
    };
    if (merged) {
      // 3 + 4 in one phase: gate/up tasks first (bind_job may lower their count), then down.
      slots.push_back(kGateUpDown);
      job.push_back({gu_max + rt.experts.size() * per_expert,
                     [st, gate_up = std::move(gate_up), down = std::move(down)](size_t task,
                                                                                 int g, int w) {
                       const size_t split = st->gate_up_tasks;
                       if (task < split) gate_up(task, g, w);
                       else down(task - split, g, w);
                     }});
    } else {
      slots.push_back(kDown);
      job.push_back({rt.experts.size() * per_expert, std::move(down)});
    }
    if (fold) {
      // 5: per (token, column chunk): each group's rows weighted in expert order, then the groups
      // summed (the order of the column-block down below: the same floats).
      slots.push_back(kCombine);
      const int chunks = (H + kCombineCols - 1) / kCombineCols;
      job.push_back({split(q * chunks), [this, st, G, H, chunks, ep](size_t task, int g, int) {
        const int chunk = int(task) * G + g;
        const MoECall& c = st->call;
        const Routing& r = st->routing;
        if (chunk >= c.q * chunks) return;
        const int t = chunk / chunks, c0 = (chunk % chunks) * kCombineCols;
        const int width = std::min(kCombineCols, H - c0);
        float* total = scratch(2 * kCombineCols);
        float* part = total + kCombineCols;
        bool first = true;
        for (int gg = 0; gg < G; ++gg) {
          if (slice(gg) == 0 && gg > 0) continue;
          float* acc = first ? total : part;
          std::fill_n(acc, width, 0.0f);
          for (size_t a = 0; slice(gg) > 0 && a < r.experts.size(); ++a)
            for (long row = r.first_row[a]; row < r.first_row[a] + r.rows[a]; ++row)
              if (r.row_token[row] == t)
                ep->axpy(r.row_weight[row], st->row_out[gg] + size_t(row) * H + c0, width, acc);
          if (!first)
            for (int i = 0; i < width; ++i) total[i] += part[i];
          first = false;
        }
        store_cols(c, H, t, c0, width, total);
      }});
    } else {
      // 5: each token's weighted rows over the NUMA groups, written once in the output dtype.
      slots.push_back(kCombine);
      job.push_back({split(token_tasks), [this, st, G, H](size_t task, int g, int) {
        const int chunk = int(task) * G + g;
        const MoECall& c = st->call;
        const Routing& r = st->routing;
        float* row = scratch(H);
        for (int t = chunk * kTokensPerTask; t < std::min(c.q, (chunk + 1) * kTokensPerTask); ++t) {
          std::fill_n(row, H, 0.0f);
          for (int j = 0; j < c.k; ++j) {
            const long src = r.slot_row[size_t(t) * c.k + j];
            for (int gg = 0; gg < G && src >= 0; ++gg)
              if (slice(gg) > 0)
                add_scaled(r.row_weight[src], st->row_out[gg] + size_t(src) * H, H, row);
          }
          store_row(c, H, t, row);
        }
      }});
    }
  } else {
    // 4: down for a block of output columns over every expert, weighted into the group's partial.
    // With one group the block is final: it goes to out here and phase 5 is not needed.
    const int nb_per_task = rt.max_rows >= 32 ? 2 : 1;
    const bool lead = cfg_.format != WeightFormat::kINT8;
    slots.push_back(kDown);
    job.push_back({size_t(H / kBlockN / nb_per_task), [this, st, nb_per_task, H, kernels_for,
                                                       tiled_for, ep, store_in_down,
                                                       lead](size_t task, int g, int) {
      const Routing& r = st->routing;
      const int nb0 = int(task) * nb_per_task, width = nb_per_task * kBlockN;
      float* acc = st->accum[g];
      for (int t = 0; t < st->call.q; ++t)
        std::fill_n(acc + size_t(t) * H + nb0 * kBlockN, width, 0.0f);
      if (slice(g) == 0) return;
      float* c = scratch(round_up(r.max_rows, 16) * width);
      for (size_t a = 0; a < r.experts.size(); ++a) {
        const int m = r.rows[a];
        const long row0 = r.first_row[a];
        const PackedMatrix& w = down_[size_t(g) * cfg_.num_experts + r.experts[a]];
        if (lead && a + 1 < r.experts.size()) {
          const PackedMatrix& next = down_[size_t(g) * cfg_.num_experts + r.experts[a + 1]];
          prefetch_start(next.n_block(nb0), nb_per_task * next.n_block_bytes());
        }
        kernels_for(m).get(cfg_.format)(w, st->hidden[g].view(row0, m, tiled_for(m)), nb0,
                                        nb0 + nb_per_task, c, width);
        for (int t = 0; t < m; ++t)
          ep->axpy(r.row_weight[row0 + t], c + t * width, width,
                  acc + size_t(r.row_token[row0 + t]) * H + nb0 * kBlockN);
      }
      for (int t = 0; store_in_down && t < st->call.q; ++t)
        store_cols(st->call, H, t, nb0 * kBlockN, width, acc + size_t(t) * H + nb0 * kBlockN);
    }});
    // 5: sum of the groups' partial outputs, written once in the output dtype.
    if (!store_in_down) {
      slots.push_back(kCombine);
      job.push_back({split(token_tasks), [this, st, G, H](size_t task, int g, int) {
        const int chunk = int(task) * G + g;
        const MoECall& c = st->call;
        for (int t = chunk * kTokensPerTask; t < std::min(c.q, (chunk + 1) * kTokensPerTask); ++t) {
          float* row = st->accum[0] + size_t(t) * H;
          for (int gg = 1; gg < G; ++gg) {
            if (slice(gg) == 0) continue;
            const float* part = st->accum[gg] + size_t(t) * H;
            for (int i = 0; i < H; ++i) row[i] += part[i];
          }
          store_row(c, H, t, row);
        }
      }});
    }
  }
  if (profile_) {
    auto clock = std::make_shared<PhaseClock>(kNumSlots);
    for (size_t i = 0; i < job.size(); ++i)
      job[i].fn = [clock, st, slot = slots[i], fn = std::move(job[i].fn)](size_t task, int g,
                                                                          int w) {
        const int p = slot != kGateUpDown ? slot : task < st->gate_up_tasks ? kGateUp : kDown;
        const int64_t start = now_ns();
        int64_t seen = clock->first[p].load();
        while (start < seen && !clock->first[p].compare_exchange_weak(seen, start)) {}
        fn(task, g, w);
        const int64_t end = now_ns();
        seen = clock->last[p].load();
        while (end > seen && !clock->last[p].compare_exchange_weak(seen, end)) {}
      };
    last_clock_ = clock;
    if (timeline_.size() < kTimelineCalls) timeline_.push_back(clock);
  }
  if (planned) *planned = st;
  return job;
}

void MoELayer::bind_job(Job* job, MoECallState& st) const {
  const MoECall& c = st.call;
  st.routing = route(c.ids, c.weights, c.q, c.k, cfg_.num_experts, gpu_mask_, loaded_,
                     c.first_slot, c.end_slot);
  const Epilogue& ep = kernels_of(std::min(cfg_.max_isa, Isa::kAvx512)).epilogue;
  for (int t = 0; t < c.q; ++t)
    convert_token(c, st.tokens, ep, cfg_.hidden, hidden_padded_, cfg_.group_size, t);
  size_t tasks = 0;
  for (int g = 0; g < num_groups(); ++g)
    tasks = std::max(tasks, st.routing.experts.size() * (slice(g) / st.cols));
  // Without `job` (a deferred part bound while its phases are queued) the task counts stay the
  // planned ones, whose tasks past the routed experts' return at once.
  st.gate_up_tasks = tasks;
  if (!job) return;
  const size_t down = st.routing.experts.size() * st.down_per_expert;
  if (st.gate_up_phase == st.down_phase) {
    (*job)[st.gate_up_phase].num_tasks = tasks + down;
  } else {
    (*job)[st.gate_up_phase].num_tasks = tasks;
    (*job)[st.down_phase].num_tasks = down;
  }
}

void MoELayer::set_decode_cols(int cols) {
  if (cols != 32 && cols != 64 && cols != 128)
    throw std::invalid_argument("decode_cols must be 32, 64 or 128, got " + std::to_string(cols));
  cfg_.decode_cols = cols;
}

JobHandle MoELayer::submit(const MoECall& call) {
  const int64_t start = profile_ ? now_ns() : 0;
  Job job = make_job(call);
  if (profile_) last_clock_->start = start, last_clock_->built = now_ns();
  return pool_.submit(std::move(job));
}

}  // namespace hetmoe
