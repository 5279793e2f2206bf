// Persistent spinning thread pool with NUMA groups and an asynchronous job queue.
//
// Contract shared by runtime/ (which implements it) and moe/ (which uses it):
// - Workers are pinned, one per core, split into `num_groups()` groups (one per NUMA node, or
//   HETMOE_NUMA_GROUPS virtual groups). By default one core is left for the caller (GPU driver).
// - A Job is a list of Phases run in order with a barrier between phases. In each phase every group
//   pulls task indices [0, num_tasks) from its own atomic counter, so skewed work balances.
// - submit() returns at once (the caller never runs tasks); wait() spins, then yields, until done.
//   Jobs submitted from any thread run one after another in submission order.
// - Hot-path waits spin with `pause`; workers park only after an idle period.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace hetmoe {

struct Phase {
  size_t num_tasks = 0;  // per group
  std::function<void(size_t task, int group, int worker_in_group)> fn;
};

using Job = std::vector<Phase>;
using JobHandle = uint64_t;

class ThreadPool {
 public:
  // num_threads <= 0: all cores of the allowed set but one. groups <= 0: from NUMA / env.
  explicit ThreadPool(int num_threads = 0, int num_groups = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  JobHandle submit(Job job);
  void wait(JobHandle handle);
  void run(Job job) { wait(submit(std::move(job))); }

  int num_threads() const;
  int num_groups() const;
  int group_size(int group) const;
  int group_node(int group) const;  // NUMA node backing the group (-1 when not bound)

 private:
  struct Impl;
  Impl* impl_;
};

// Memory on a NUMA node (libnuma when built with it, else plain aligned allocation).
void* numa_alloc(size_t bytes, int node, size_t alignment = 64);
void numa_free(void* ptr, size_t bytes);

}  // namespace hetmoe
