// Timing of profiled MoE calls (MoELayer::set_profile): per phase slot the first task's start and
// the last task's end, the call's stamps (MoELayer::take_timeline), and every task's span
// (MoELayer::task_spans).
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

// One task of a profiled call: its phase slot, the worker that ran it and when.
struct TaskSpan {
  int32_t slot = 0, group = 0, worker = 0;
  int64_t start = 0, end = 0;
};

struct PhaseClock {
  PhaseClock(size_t n, size_t tasks)
      : first(new std::atomic<int64_t>[n]), last(new std::atomic<int64_t>[n]), size(n),
        spans(new TaskSpan[tasks]), span_capacity(tasks) {
    for (size_t i = 0; i < n; ++i) first[i] = INT64_MAX, last[i] = 0;
  }
  std::unique_ptr<std::atomic<int64_t>[]> first, last;
  size_t size;
  std::unique_ptr<TaskSpan[]> spans;  // in order of completion
  size_t span_capacity;
  std::atomic<size_t> span_count{0};
  // See MoELayer::take_timeline.
  int64_t start = 0, built = 0, done = 0, picked = 0, made = 0, claimed = 0;
};

}  // namespace hetmoe
