#include "testing/flag_count_job.h"

#include <chrono>
#include <stdexcept>
#include <string>

#include "runtime/spin.h"

namespace hetmoe {

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
