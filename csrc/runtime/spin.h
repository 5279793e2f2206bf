// Busy-wait helpers shared by the pool and its users: `pause` while spinning, yield past a budget.
#pragma once

#include <sched.h>

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace hetmoe {

inline constexpr size_t kCacheLine = 64;
// Spins between clock reads / sched_yield calls (a few tens of µs of `pause`).
inline constexpr uint32_t kSpinsPerCheck = 1024;

// One spin-wait step: `pause` tells the core it is a spin loop (saves power, frees the sibling).
inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spin on `done()` with pause for about `spin_us`, then keep checking between sched_yield calls.
template <class Pred>
void spin_then_yield(Pred done, int spin_us) {
  for (uint32_t i = 0; i < 64; ++i) {  // short jobs: no clock read at all
    if (done()) return;
    cpu_pause();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  for (uint32_t spins = 1; !done(); ++spins) {
    cpu_pause();
    if (spins % 64 == 0 && std::chrono::steady_clock::now() > deadline) {
      while (!done()) sched_yield();
      return;
    }
  }
}

}  // namespace hetmoe
