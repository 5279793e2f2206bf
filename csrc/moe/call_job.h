// The job of one MoE call: its phases, built from the call's state (call_state.h) as its plan
// names them (call_plan.h), each phase's task a named function of the state.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "moe/call_state.h"
#include "runtime/pool.h"

namespace hetmoe {

// A job's phases and the PhaseSlot each reports under (MoELayer::phase_us, take_timeline).
struct PhaseList {
  Job job;
  std::vector<int> slots;

  void add(PhaseSlot slot, size_t tasks, decltype(Phase::fn) fn) {
    slots.push_back(slot);
    job.push_back({tasks, std::move(fn)});
  }
};

// Decode: gate/up + down as one phase (kDecodeComputePhase), then the combine. The tokens are
// converted by convert_tokens before the job runs: when it is made, or for a planned job (made
// before its ids are written) once it is routed, when its task counts are set again.
PhaseList decode_job(const std::shared_ptr<MoECallState>& st);
inline constexpr size_t kDecodeComputePhase = 0;
void convert_tokens(MoECallState& st);

// Prefill: convert, gather, gate/up, down, then the combine unless plan.store_in_down.
PhaseList prefill_job(const std::shared_ptr<MoECallState>& st);

}  // namespace hetmoe
