// A counting pool job gated by StreamFlags, for tests of the flag protocol (hetmoe._cpu_testing).
#pragma once

#include <atomic>
#include <cstdint>

#include "runtime/pool.h"
#include "runtime/stream_flags.h"

namespace hetmoe {

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
