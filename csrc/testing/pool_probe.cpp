#include "testing/pool_probe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

namespace hetmoe {
namespace {

void check_sizes(int num_phases, int tasks_per_phase, const char* where) {
  if (num_phases < 0 || tasks_per_phase < 0) {
    throw std::invalid_argument(std::string(where) + ": phases and tasks must be >= 0, got " +
                                std::to_string(num_phases) + " and " +
                                std::to_string(tasks_per_phase));
  }
}

}  // namespace

CountReport run_count_job(ThreadPool& pool, int num_phases, int tasks_per_phase, int fail_phase,
                          int fail_task) {
  check_sizes(num_phases, tasks_per_phase, "run_count_job");
  const int groups = pool.num_groups();
  const size_t per_phase = static_cast<size_t>(groups) * tasks_per_phase;
  std::unique_ptr<std::atomic<int>[]> counts(new std::atomic<int>[num_phases * per_phase]());
  std::unique_ptr<std::atomic<size_t>[]> ended(new std::atomic<size_t>[num_phases + 1]());
  std::atomic<bool> ordered{true}, only_workers{true}, ids_valid{true};
  const std::thread::id caller = std::this_thread::get_id();

  Job job;
  for (int p = 0; p < num_phases; ++p) {
    job.push_back({static_cast<size_t>(tasks_per_phase), [&, p](size_t task, int g, int w) {
      if (p > 0 && ended[p - 1].load() != per_phase) ordered = false;
      if (std::this_thread::get_id() == caller) only_workers = false;
      if (g < 0 || g >= groups || w < 0 || w >= pool.group_size(g)) {
        ids_valid = false;
        return;
      }
      if (p == fail_phase && g == 0 && static_cast<int>(task) == fail_task) {
        throw std::runtime_error("injected test failure");
      }
      counts[p * per_phase + g * tasks_per_phase + task].fetch_add(1);
      ended[p].fetch_add(1);
    }});
  }
  pool.run(std::move(job));

  CountReport report;
  report.num_phases = num_phases;
  report.num_groups = groups;
  report.tasks_per_phase = tasks_per_phase;
  for (size_t i = 0; i < num_phases * per_phase; ++i) report.counts.push_back(counts[i].load());
  report.phases_ordered = ordered;
  report.only_workers = only_workers;
  report.ids_valid = ids_valid;
  return report;
}

StressReport run_stress(ThreadPool& pool, int num_jobs, int num_phases, int tasks_per_phase) {
  check_sizes(num_phases, tasks_per_phase, "run_stress");
  const int64_t groups = pool.num_groups();
  // Job j, phase p, task t adds (j+1)*(p+1)*(t+1) once per group.
  auto expected = [&](int64_t j) {
    int64_t tri = int64_t(tasks_per_phase) * (tasks_per_phase + 1) / 2;
    return groups * (j + 1) * tri * (int64_t(num_phases) * (num_phases + 1) / 2);
  };
  std::unique_ptr<std::atomic<int64_t>[]> sums(new std::atomic<int64_t>[num_jobs]());
  std::atomic<bool> in_order{true};
  std::vector<JobHandle> handles;
  for (int j = 0; j < num_jobs; ++j) {
    Job job;
    for (int p = 0; p < num_phases; ++p) {
      job.push_back({static_cast<size_t>(tasks_per_phase), [&, j, p](size_t task, int, int) {
        if (p == 0 && j > 0 && sums[j - 1].load() != expected(j - 1)) in_order = false;
        sums[j].fetch_add(int64_t(j + 1) * (p + 1) * int64_t(task + 1));
      }});
    }
    handles.push_back(pool.submit(std::move(job)));
  }
  for (auto it = handles.rbegin(); it != handles.rend(); ++it) pool.wait(*it);

  StressReport report;
  report.num_jobs = num_jobs;
  for (int j = 0; j < num_jobs; ++j) report.correct += sums[j].load() == expected(j) ? 1 : 0;
  report.in_order = in_order;
  return report;
}

OverheadReport measure_overhead(ThreadPool& pool, int iters, int tasks_per_group, int warmup) {
  if (iters < 1 || tasks_per_group < 0 || warmup < 0) {
    throw std::invalid_argument(
        "measure_overhead: need iters >= 1, tasks_per_group >= 0 and warmup >= 0, got " +
        std::to_string(iters) + ", " + std::to_string(tasks_per_group) + " and " +
        std::to_string(warmup));
  }
  std::atomic<size_t> sink{0};
  auto make_job = [&] {
    Phase phase{static_cast<size_t>(tasks_per_group), nullptr};
    if (tasks_per_group > 0) {
      phase.fn = [&sink](size_t task, int, int) {
        sink.fetch_add(task, std::memory_order_relaxed);
      };
    }
    return Job{std::move(phase)};
  };
  for (int i = 0; i < warmup; ++i) pool.run(make_job());

  std::vector<double> samples;
  for (int i = 0; i < iters; ++i) {
    Job job = make_job();
    auto start = std::chrono::steady_clock::now();
    pool.wait(pool.submit(std::move(job)));
    auto stop = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
  }
  std::sort(samples.begin(), samples.end());
  OverheadReport report;
  report.iters = iters;
  report.median_us = samples[samples.size() / 2];
  report.p90_us = samples[std::min(samples.size() - 1, samples.size() * 9 / 10)];
  report.min_us = samples.front();
  return report;
}

}  // namespace hetmoe
