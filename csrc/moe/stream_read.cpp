// Plain multithreaded read (stream_read.h): sums 64-bit words so no load can be skipped.
// Each worker prefetches 4 KB ahead, as the decode kernels do: one core's demand loads alone
// keep too few lines in flight on some hosts (a probe slower than the kernels it bounds).
#include "moe/stream_read.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>

namespace hetmoe {

double read_bandwidth(ThreadPool& pool, size_t bytes, int repeats) {
  constexpr size_t kChunk = size_t(1) << 20;
  constexpr size_t kAhead = 4096 / 8;  // words: 4 KB ahead (the last 4 KB of a chunk run past
                                       // its end; prefetches never fault)
  const size_t chunks = std::max<size_t>(1, bytes / kChunk), G = size_t(pool.num_groups());
  uint8_t* data = static_cast<uint8_t*>(numa_alloc(chunks * kChunk, -1, 64));
  std::atomic<uint64_t> sink{0};
  // Touch pages from the workers (first touch places them, as the weights are placed).
  const size_t per_group = (chunks + G - 1) / G;
  pool.run(Job{Phase{per_group, [&](size_t task, int g, int) {
    const size_t c = task * G + g;
    if (c < chunks) std::memset(data + c * kChunk, int(c & 0xFF), kChunk);
  }}});
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    pool.run(Job{Phase{per_group, [&](size_t task, int g, int) {
      const size_t c = task * G + g;
      if (c >= chunks) return;
      const uint64_t* p = reinterpret_cast<const uint64_t*>(data + c * kChunk);
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (size_t i = 0; i < kChunk / 8; i += 8) {  // one 64-byte line per step
        __builtin_prefetch(p + i + kAhead, 0, 3);
        s0 += p[i] + p[i + 4];
        s1 += p[i + 1] + p[i + 5];
        s2 += p[i + 2] + p[i + 6];
        s3 += p[i + 3] + p[i + 7];
      }
      sink.fetch_add(s0 + s1 + s2 + s3, std::memory_order_relaxed);
    }}});
    const std::chrono::duration<double> sec = std::chrono::steady_clock::now() - start;
    best = std::max(best, double(chunks * kChunk) / sec.count());
  }
  numa_free(data, chunks * kChunk);
  return sink.load() == 1 ? 0 : best;  // keeps the sums alive; never 1 in practice
}

}  // namespace hetmoe
