// Self-checks and measurements of a ThreadPool, behind the Python introspection API and tests.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "runtime/pool.h"
#include "runtime/stream_flags.h"
#include "runtime/topology.h"

namespace hetmoe {

struct CountReport {
  int num_phases = 0, num_groups = 0, tasks_per_phase = 0;
  std::vector<int> counts;      // [phase][group][task]: how often each task ran (must be 1)
  bool phases_ordered = true;   // no task started before every task of the previous phase ended
  bool only_workers = true;     // no task ran on the submitting thread
  bool ids_valid = true;        // group / worker_in_group arguments in range
};

// One job of `num_phases` phases x `tasks_per_phase` tasks per group. With fail_phase >= 0, task
// `fail_task` of group 0 in that phase throws, and the pool's error propagates from here.
CountReport run_count_job(ThreadPool& pool, int num_phases, int tasks_per_phase,
                          int fail_phase = -1, int fail_task = 0);

struct StressReport {
  int num_jobs = 0;
  int correct = 0;        // jobs whose tasks all ran exactly once
  bool in_order = true;   // every job started after the previous one (same caller) had finished
};

// Submits `num_jobs` jobs back to back (more than the queue holds is fine), then waits them in
// reverse order. Safe to call from several threads at once.
StressReport run_stress(ThreadPool& pool, int num_jobs, int num_phases, int tasks_per_phase);

struct OverheadReport {
  int iters = 0;
  double median_us = 0, p90_us = 0, min_us = 0;
};

// submit() -> wait() time of a prebuilt one-phase job with `tasks_per_group` trivial tasks per
// group (0: an empty job), after `warmup` untimed jobs (which also wake parked workers; 0 times
// the wake-up itself).
OverheadReport measure_overhead(ThreadPool& pool, int iters, int tasks_per_group, int warmup = 200);

struct NumaAllocReport {
  bool aligned = false;         // the pointer honours the requested alignment
  bool huge_page_aligned = false;  // ... and starts on a 2 MiB boundary
  std::vector<int> page_nodes;  // node of the first, middle and last page after writing them
                                // (negative: the kernel's -errno, e.g. no NUMA support)
};

// numa_alloc(bytes, node, alignment), write every byte, ask the kernel where the pages landed,
// numa_free. bytes == 0 gives a null pointer and no pages.
NumaAllocReport check_numa_alloc(size_t bytes, int node, size_t alignment);

// A job gated by StreamFlags (ThreadPool::submit_built): each run's prepare step adds one to
// `prepared` (throws while `fail_prepare` is set), its build step waits for the ready word (and
// counts in `unprepared_builds` a build that came before its prepare), then it adds one per task
// and group to `count`, throws in task 0 of group 0 while `fail` is set, and sets done. With
// `watch` set, task 0 of group 0 spins (up to 2 s) until `watch` was prepared, recording it in
// `saw_watch_prepared`: a later job's prepare step runs while this one does. Checks the flag
// protocol's CPU side without a GPU (a test writes the "GPU" words).
struct FlagCountJob {
  FlagCountJob(ThreadPool& pool, StreamFlags& flags, int tasks_per_group);
  JobHandle submit();
  ThreadPool& pool;
  StreamFlags& flags;
  const int tasks_per_group;
  std::atomic<int64_t> count{0}, prepared{0}, builds{0}, unprepared_builds{0};
  std::atomic<bool> fail{false}, fail_prepare{false}, saw_watch_prepared{false};
  FlagCountJob* watch = nullptr;
};

}  // namespace hetmoe
