// Timing of profiled MoE calls (MoELayer::set_profile): per phase slot the first task's start and
// the last task's end, and the call's stamps (MoELayer::take_timeline).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace hetmoe {

// Profiled calls kept per layer until take_timeline() (about 1 MB); later ones are not kept.
inline constexpr size_t kTimelineCalls = 4096;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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

}  // namespace hetmoe
