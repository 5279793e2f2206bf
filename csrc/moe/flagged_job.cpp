// MoELayer::submit_flagged: the bound call as a pool job that a GPU stream starts and awaits
// through StreamFlags, optionally followed by its deferred slots (moe_layer.h).
#include <atomic>
#include <exception>
#include <stdexcept>
#include <string>

#include "moe/call_job.h"
#include "moe/moe_layer.h"
#include "moe/phase_clock.h"

namespace hetmoe {

// One flagged job's parts (the immediate slots, then with deferral the deferred ones), handed
// from its prepare step to its build and finish steps.
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

namespace {

// The parts of the bound call: its first k - deferred slots into its out (done on `flags`), then
// with deferral its last `deferred` slots into late_out (done on late_flags).
std::shared_ptr<FlaggedParts> flagged_parts(const MoECall& c, StreamFlags& flags, int deferred,
                                            StreamFlags* late_flags, void* late_out) {
  auto fp = std::make_shared<FlaggedParts>();
  fp->calls = {c};
  fp->done = {&flags};
  if (deferred != 0) {
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
  fp->planned.resize(fp->calls.size());
  fp->jobs.resize(fp->calls.size());
  return fp;
}

}  // namespace

JobHandle MoELayer::submit_flagged(StreamFlags& flags, int deferred, StreamFlags* late_flags,
                                   void* late_out) {
  std::shared_ptr<FlaggedParts> fp =
      flagged_parts(bound_call_, flags, deferred, late_flags, late_out);
  return pool_.submit_built([this, fp] { return build_flagged(fp); },
                            [this, fp] { finish_flagged(*fp); },
                            [this, fp] { prepare_flagged(*fp); });
}

// Prepare: a decode part's job is made while earlier jobs run and the GPU still computes its
// inputs; only its routing and token conversion wait for the ready word.
void MoELayer::prepare_flagged(FlaggedParts& fp) const {
  fp.picked = profile_ ? now_ns() : 0;
  try {
    for (size_t p = 0; p < fp.calls.size() && fp.calls[p].q <= kDecodeMaxTokens; ++p) {
      fp.jobs[p] = make_job(fp.calls[p], &fp.planned[p]);
      if (profile_) fp.clocks.push_back(last_clock_);
    }
  } catch (...) {
    fp.failed = std::current_exception();
  }
  fp.made = profile_ ? now_ns() : 0;
}

// Build: once the ready word is set, route and convert (or make the parts that are not decode
// calls), then hand the phases over: the first part's, its done word, the deferred part's.
Job MoELayer::build_flagged(const std::shared_ptr<FlaggedParts>& fp) const {
  const int64_t claimed = profile_ ? now_ns() : 0;
  if (!fp->done[0]->wait_ready()) return Job{};
  if (fp->failed) std::rethrow_exception(fp->failed);
  const int64_t ready = profile_ ? now_ns() : 0;
  for (size_t p = 0; p < fp->calls.size(); ++p) {
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
  if (fp->calls.size() > 1) chain_deferred(job, fp);
  return job;
}

// Appends the first part's done word and the deferred part's phases to the first part's job.
void MoELayer::chain_deferred(Job& job, const std::shared_ptr<FlaggedParts>& fp) const {
  if (fp->planned[1]) {
    // The deferred part is routed by one more task of the first part's last phase (a decode
    // combine leaves most workers idle); its phases keep their planned task counts, whose tasks
    // beyond the routed experts return at once.
    Phase& last = job.back();
    const size_t extra = last.num_tasks;
    last.num_tasks += 1;
    last.fn = [this, fp, extra, inner = std::move(last.fn)](size_t task, int g, int w) {
      if (task < extra) inner(task, g, w);
      else if (g == 0) bind_job(nullptr, *fp->planned[1]);
    };
  }
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
}

// Finish: runs before any later job of the pool starts, also after a failure: every done word
// not set yet is set, so the stream never waits for a part that will not run.
void MoELayer::finish_flagged(FlaggedParts& fp) const {
  const int64_t t = profile_ ? now_ns() : 0;
  for (size_t p = fp.signalled.load(std::memory_order_acquire); p < fp.calls.size(); ++p) {
    if (p < fp.clocks.size()) fp.clocks[p]->done = t;
    fp.done[p]->signal_done();
  }
}

}  // namespace hetmoe
