// The job of one MoELayer call: routed, planned (call_plan.h), its state made (call_state.h) and
// its phases built (decode_job.cpp, prefill_job.cpp); profiling of the calls.
#include <algorithm>
#include <array>
#include <stdexcept>
#include <string>

#include "moe/call_job.h"
#include "moe/moe_layer.h"
#include "moe/phase_clock.h"

namespace hetmoe {

LayerRef MoELayer::layer_ref() const {
  return {slice_begin_.data(), gate_up_.data(), down_.data(), cfg_.num_experts};
}

Job MoELayer::make_job(const MoECall& call, std::shared_ptr<MoECallState>* planned) const {
  // A planned job's ids are not written yet: it is sized for the most experts it can reach.
  Routing routing = planned ? most_experts_routing(call, cfg_.num_experts)
                            : route(call.ids, call.weights, call.q, call.k, cfg_.num_experts,
                                    gpu_mask_, loaded_, call.first_slot, call.end_slot);
  const CallPlan plan =
      plan_call(cfg_, slice_begin_, hidden_padded_, call.q, routing, pool_.group_size(0));
  std::shared_ptr<MoECallState> st = make_call_state(call, std::move(routing), plan, layer_ref());
  // Decode tokens are converted here, before the pool starts (a microsecond or two each).
  if (plan.decode() && !planned) convert_tokens(*st);
  PhaseList phases = plan.decode() ? decode_job(st) : prefill_job(st);
  if (profile_) clock_phases(phases, st);
  if (planned) *planned = st;
  return std::move(phases.job);
}

void MoELayer::bind_job(Job* job, MoECallState& st) const {
  const MoECall& c = st.call;
  st.routing = route(c.ids, c.weights, c.q, c.k, cfg_.num_experts, gpu_mask_, loaded_,
                     c.first_slot, c.end_slot);
  convert_tokens(st);
  bind_plan(st.plan, slice_begin_, st.routing.experts.size());
  // Without `job` (a deferred part bound while its phases are queued) the task counts stay the
  // planned ones, whose tasks past the routed experts return at once.
  if (job) (*job)[kDecodeComputePhase].num_tasks = st.plan.gate_up_tasks + st.plan.down_tasks;
}

// Wraps every task to record its span and its phase slot's first start and last end.
void MoELayer::clock_phases(PhaseList& phases, const std::shared_ptr<MoECallState>& st) const {
  size_t tasks = 0;  // span slots: none unless asked for (set_profile)
  if (profile_spans_)
    for (const Phase& phase : phases.job) tasks += phase.num_tasks * size_t(st->plan.groups);
  auto clock = std::make_shared<PhaseClock>(kNumSlots, tasks);
  for (size_t i = 0; i < phases.job.size(); ++i)
    phases.job[i].fn = [clock, st, slot = phases.slots[i],
                        fn = std::move(phases.job[i].fn)](size_t task, int g, int w) {
      const int p = slot != kGateUpDown ? slot
                    : task < st->plan.gate_up_tasks ? kGateUp
                                                    : kDown;
      const int64_t start = now_ns();
      int64_t seen = clock->first[p].load();
      while (start < seen && !clock->first[p].compare_exchange_weak(seen, start)) {}
      fn(task, g, w);
      const int64_t end = now_ns();
      if (clock->span_capacity) {  // spans asked for: one shared counter hit per task
        const size_t at = clock->span_count.fetch_add(1);
        if (at < clock->span_capacity) clock->spans[at] = {p, g, w, start, end};
      }
      seen = clock->last[p].load();
      while (end > seen && !clock->last[p].compare_exchange_weak(seen, end)) {}
    };
  last_clock_ = clock;
  if (timeline_.size() < kTimelineCalls) timeline_.push_back(clock);
}

JobHandle MoELayer::submit(const MoECall& call) {
  const int64_t start = profile_ ? now_ns() : 0;
  Job job = make_job(call);
  if (profile_) last_clock_->start = start, last_clock_->built = now_ns();
  return pool_.submit(std::move(job));
}

void MoELayer::set_decode_cols(int cols) {
  if (cols != 32 && cols != 64 && cols != 128)
    throw std::invalid_argument("decode_cols must be 32, 64 or 128, got " + std::to_string(cols));
  cfg_.decode_cols = cols;
}

std::vector<double> MoELayer::phase_us() const {
  std::vector<double> us;
  for (size_t i = 0; last_clock_ && i < last_clock_->size; ++i)
    us.push_back(last_clock_->last[i] > 0
                     ? double(last_clock_->last[i] - last_clock_->first[i]) / 1e3
                     : 0.0);
  return us;
}

std::vector<std::array<int64_t, 5>> MoELayer::task_spans() const {
  std::vector<std::array<int64_t, 5>> rows;
  if (!last_clock_) return rows;
  const size_t n = std::min(last_clock_->span_count.load(), last_clock_->span_capacity);
  for (size_t i = 0; i < n; ++i) {
    const TaskSpan& s = last_clock_->spans[i];
    rows.push_back({s.slot, s.group, s.worker, s.start, s.end});
  }
  return rows;
}

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

}  // namespace hetmoe
