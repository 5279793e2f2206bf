#include "runtime/pool_probe.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "runtime/spin.h"

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

NumaAllocReport check_numa_alloc(size_t bytes, int node, size_t alignment) {
  NumaAllocReport report;
  auto* ptr = static_cast<unsigned char*>(numa_alloc(bytes, node, alignment));
  report.aligned = reinterpret_cast<uintptr_t>(ptr) % alignment == 0;
  report.huge_page_aligned = reinterpret_cast<uintptr_t>(ptr) % kHugePageBytes == 0;
  if (ptr == nullptr) return report;
  std::fill(ptr, ptr + bytes, static_cast<unsigned char>(0x5a));
  void* pages[3] = {ptr, ptr + bytes / 2, ptr + bytes - 1};
  int status[3] = {0, 0, 0};
  // move_pages with no target nodes only reports where each page lives.
  syscall(SYS_move_pages, 0, 3UL, pages, nullptr, status, 0);
  report.page_nodes.assign(status, status + 3);
  numa_free(ptr, bytes);
  return report;
}

FlagCountJob::FlagCountJob(ThreadPool& pool, StreamFlags& flags, int tasks)
    : pool(pool), flags(flags), tasks_per_group(tasks) {
  if (tasks < 0) {
    throw std::invalid_argument("FlagCountJob: tasks_per_group must be >= 0, got " +
                                std::to_string(tasks));
  }
}

JobHandle FlagCountJob::submit() {
  return pool.submit_built(
      [this] {
        if (prepared.load() <= builds.fetch_add(1)) unprepared_builds.fetch_add(1);
        if (!flags.wait_ready()) return Job{};
        return Job{{static_cast<size_t>(tasks_per_group), [this](size_t task, int group, int) {
          if (task == 0 && group == 0 && fail.load()) {
            throw std::runtime_error("injected flag-job failure");
          }
          if (task == 0 && group == 0 && watch != nullptr) {
            const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
            while (watch->prepared.load() == 0 && std::chrono::steady_clock::now() < until) {
              cpu_pause();
            }
            saw_watch_prepared.store(watch->prepared.load() > 0);
          }
          count.fetch_add(1);
        }}};
      },
      [this] { flags.signal_done(); },
      [this] {
        if (fail_prepare.load()) throw std::runtime_error("injected prepare failure");
        prepared.fetch_add(1);
      });
}

}  // namespace hetmoe
