// Self-checks and measurements of a ThreadPool, for tests and benchmarks (hetmoe._cpu_testing).
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "runtime/pool.h"

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

}  // namespace hetmoe
