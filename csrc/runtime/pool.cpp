// ThreadPool: a ring of job slots; every worker runs every job, phase by phase, pulling task
// indices from its group's counter; the last worker to reach a phase's barrier opens the next one.
#include "runtime/pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <algorithm>
#include <climits>
#include <cmath>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>

#include "runtime/spin.h"
#include "runtime/topology.h"

namespace hetmoe {
namespace {

// Atomics written by different parties live on their own cache lines.
struct alignas(kCacheLine) PaddedCounter {
  std::atomic<size_t> value{0};
};

struct alignas(kCacheLine) Slot {
  Job job;
  std::function<Job()> build;    // submit_built: makes `job` when the job starts
  std::function<void()> finish;  // submit_built: runs after the last phase
  std::function<void()> prepare;  // submit_built: runs before build, maybe during earlier jobs
  std::atomic<bool> build_claimed{false};
  std::atomic<int> prepare_state{0};  // 0 not started, 1 running, 2 done
  alignas(kCacheLine) std::atomic<bool> built{false};  // `job` is made (submit_built)
  std::unique_ptr<PaddedCounter[]> counters;      // [num_groups], the current phase's next task
  std::unique_ptr<PaddedCounter[]> team_arrived;  // [num_teams], members at the current barrier
  alignas(kCacheLine) std::atomic<int> arrived{0};  // teams whose members have all arrived
  alignas(kCacheLine) std::atomic<uint32_t> phase_gen{0};  // phases whose barrier has opened
  std::atomic<bool> failed{false};  // set on a task's exception: the rest of the job is skipped
};

struct Failure {
  std::exception_ptr error;
  size_t phase = 0, task = 0;
  int group = 0;
  const char* stage = nullptr;  // "build" / "finish" of a submit_built job; nullptr: a task
};

thread_local const void* tl_worker_of = nullptr;  // the pool whose worker this thread is

// Parking is a plain futex on a 32-bit epoch: no spinning or timed sleeps hidden in a library.
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
              std::atomic<uint32_t>::is_always_lock_free);

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

}  // namespace

struct ThreadPool::Impl {
  WorkerPlan plan;
  std::vector<int> group_of;  // [num_threads]
  // Barrier arrival is two-level: about sqrt(n) teams of adjacent workers, each with its own
  // counter, so no cache line takes more than ~sqrt(n) contended increments per barrier.
  std::vector<int> team_of;       // [num_threads]
  std::vector<int> team_members;  // [num_teams]
  std::vector<std::thread> threads;
  std::unique_ptr<Slot[]> slots;
  std::atomic<int> pinned{0};
  std::atomic<int> started{0};
  // Workers on every allowed CPU share cores with the caller: hand the CPU over sooner.
  uint32_t spins_per_yield = kSpinsPerCheck;

  // Spins (pause) until `done()`, yielding the core every spins_per_yield spins.
  template <class Pred>
  void spin_until(Pred done) const {
    for (uint32_t spins = 1; !done(); ++spins) {
      cpu_pause();
      if (spins % spins_per_yield == 0) sched_yield();
    }
  }

  alignas(kCacheLine) std::atomic<uint64_t> published{0};  // jobs submitted (= next handle)
  alignas(kCacheLine) std::atomic<uint64_t> completed{0};  // jobs finished, in order
  alignas(kCacheLine) std::atomic<int> parked{0};
  std::atomic<uint32_t> park_epoch{0};
  std::atomic<bool> stop{false};
  alignas(kCacheLine) std::mutex submit_mu;
  std::mutex failures_mu;
  std::atomic<int> num_failures{0};
  std::map<uint64_t, Failure> failures;  // by job handle, until wait() reports it

  int num_threads() const { return static_cast<int>(plan.cpus.size()); }

  void worker_main(int worker, const void* owner) {
    tl_worker_of = owner;
    pthread_setname_np(pthread_self(), ("hetmoe-w" + std::to_string(worker)).c_str());
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(plan.cpus[worker], &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0) pinned.fetch_add(1);
    started.fetch_add(1, std::memory_order_release);
    const int group = group_of[worker];
    const int in_group = worker - plan.groups[group].first;
    for (uint64_t next = 0;; ++next) {
      if (!wait_for_job(next)) return;
      run_job(next, worker, group, in_group);
    }
  }

  // Spin (with pause) until job `next` is published; park after an idle period. False on stop.
  bool wait_for_job(uint64_t next) {
    if (published.load(std::memory_order_acquire) > next) return true;
    auto idle_since = std::chrono::steady_clock::now();
    for (uint32_t spins = 1;; ++spins) {
      if (published.load(std::memory_order_acquire) > next) return true;
      if (stop.load(std::memory_order_relaxed)) return false;
      cpu_pause();
      if (spins % spins_per_yield != 0) continue;
      // Let other runnable threads on this CPU go first (cheap when there are none).
      sched_yield();
      auto now = std::chrono::steady_clock::now();
      if (now - idle_since > std::chrono::microseconds(kPoolIdleBeforeParkUs)) {
        park(next);
        idle_since = std::chrono::steady_clock::now();
      }
    }
  }

  void park(uint64_t next) {
    uint32_t epoch = park_epoch.load(std::memory_order_acquire);
    parked.fetch_add(1, std::memory_order_seq_cst);
    // Pairs with submit(): either it sees `parked` and bumps the epoch, or we see its job here.
    if (published.load(std::memory_order_seq_cst) <= next && !stop.load()) {
      futex_wait(park_epoch, epoch);  // returns at once if the epoch already moved
    }
    parked.fetch_sub(1, std::memory_order_relaxed);
  }

  void wake_parked() {
    park_epoch.fetch_add(1, std::memory_order_release);
    futex_wake_all(park_epoch);
  }

  void run_job(uint64_t seq, int worker, int group, int in_group) {
    Slot& slot = slots[seq % kPoolQueueCapacity];
    uint32_t opened = 0;  // phase barriers passed
    if (slot.build) {
      if (!slot.build_claimed.exchange(true, std::memory_order_acq_rel)) {
        build_job(slot, seq);
        slot.built.store(true, std::memory_order_release);  // publishes slot.job
        // While the others run this job, its builder makes the next job's early part.
        prepare_job(seq + 1, false);
      } else {
        spin_until([&] { return slot.built.load(std::memory_order_acquire); });
      }
    }
    const size_t num_phases = slot.job.size();
    const uint32_t barriers = num_phases == 0 ? 1 : static_cast<uint32_t>(num_phases);
    for (uint32_t p = 0; p < barriers; ++p) {
      if (p < num_phases && slot.job[p].num_tasks > 0) {
        const Phase& phase = slot.job[p];
        std::atomic<size_t>& counter = slot.counters[group].value;
        while (!slot.failed.load(std::memory_order_relaxed)) {
          size_t task = counter.fetch_add(1, std::memory_order_relaxed);
          if (task >= phase.num_tasks) break;
          try {
            phase.fn(task, group, in_group);
          } catch (...) {
            record_failure(slot, seq, {std::current_exception(), p, task, group});
          }
        }
      }
      barrier(slot, seq, opened++, p + 1 == barriers, team_of[worker]);
    }
  }

  // Runs job `seq`'s prepare once, if it is queued and has one. `wait`: return only once it has
  // run (on this worker or another); else leave it to whoever claimed it.
  void prepare_job(uint64_t seq, bool wait) {
    if (published.load(std::memory_order_acquire) <= seq) return;
    Slot& slot = slots[seq % kPoolQueueCapacity];
    if (!slot.prepare) return;
    int state = 0;
    if (slot.prepare_state.compare_exchange_strong(state, 1, std::memory_order_acq_rel)) {
      try {
        slot.prepare();
      } catch (...) {
        record_failure(slot, seq, {std::current_exception(), 0, 0, 0, "prepare"});
      }
      slot.prepare_state.store(2, std::memory_order_release);
      return;
    }
    if (wait) spin_until([&] { return slot.prepare_state.load(std::memory_order_acquire) == 2; });
  }

  void build_job(Slot& slot, uint64_t seq) {
    prepare_job(seq, true);
    if (slot.failed.load(std::memory_order_acquire)) return;  // the prepare threw
    try {
      slot.job = slot.build();
      for (size_t p = 0; p < slot.job.size(); ++p) {
        if (slot.job[p].num_tasks > 0 && !slot.job[p].fn) {
          throw std::invalid_argument("phase " + std::to_string(p) + " has " +
                                      std::to_string(slot.job[p].num_tasks) +
                                      " tasks but no function");
        }
      }
    } catch (...) {
      slot.job.clear();
      record_failure(slot, seq, {std::current_exception(), 0, 0, 0, "build"});
    }
  }

  void record_failure(Slot& slot, uint64_t seq, Failure failure) {
    if (slot.failed.exchange(true)) return;  // only the first failure of a job is kept
    std::lock_guard<std::mutex> lock(failures_mu);
    failures[seq] = std::move(failure);
    num_failures.fetch_add(1, std::memory_order_release);
  }

  void barrier(Slot& slot, uint64_t seq, uint32_t p, bool last_phase, int team) {
    std::atomic<size_t>& in_team = slot.team_arrived[team].value;
    bool last = in_team.fetch_add(1, std::memory_order_acq_rel) + 1 ==
                static_cast<size_t>(team_members[team]);
    if (last) {
      // The team is complete and cannot touch its counter again before this barrier opens.
      in_team.store(0, std::memory_order_relaxed);
      last = slot.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 ==
             static_cast<int>(team_members.size());
    }
    if (last) {
      // Last to arrive: everyone else is done with phase p, so resetting is race-free.
      slot.arrived.store(0, std::memory_order_relaxed);
      for (size_t g = 0; g < plan.groups.size(); ++g) {
        slot.counters[g].value.store(0, std::memory_order_relaxed);
      }
      if (last_phase) {
        // finish first: a signal it sends (a GPU's done word) does not wait for the teardown.
        if (slot.finish) {
          try {
            slot.finish();
          } catch (...) {
            record_failure(slot, seq, {std::current_exception(), 0, 0, 0, "finish"});
          }
        }
        // The job's functions (and the state they hold) die on this worker once the others
        // have gone on to the next job; the slot is free for a later submit() at once.
        Job job = std::move(slot.job);
        std::function<Job()> build = std::move(slot.build);
        std::function<void()> finish = std::move(slot.finish), prepare = std::move(slot.prepare);
        slot.job.clear();
        slot.build = nullptr;
        slot.finish = slot.prepare = nullptr;
        completed.store(seq + 1, std::memory_order_release);
      } else {
        slot.phase_gen.store(p + 1, std::memory_order_release);
      }
      return;
    }
    // The final barrier waits on the global `completed`, never on the slot: once the job is
    // complete, submit() may already be refilling this slot for a later job.
    spin_until([&] {
      return last_phase ? completed.load(std::memory_order_acquire) > seq
                        : slot.phase_gen.load(std::memory_order_acquire) > p;
    });
  }

  int wait_spin_us() const { return num_threads() < plan.allowed_cpus ? kPoolWaitSpinUs : 0; }

  void wait_completed(uint64_t count) const {
    spin_then_yield([&] { return completed.load(std::memory_order_acquire) >= count; },
                    wait_spin_us());
  }
};

ThreadPool::ThreadPool(int num_threads, int num_groups) : impl_(new Impl) {
  std::unique_ptr<Impl> impl(impl_);
  impl->plan = plan_workers(hetmoe::allowed_cpus(), num_threads, num_groups);
  for (size_t g = 0; g < impl->plan.groups.size(); ++g) {
    impl->group_of.insert(impl->group_of.end(), impl->plan.groups[g].size, static_cast<int>(g));
  }
  if (impl->num_threads() >= impl->plan.allowed_cpus) impl->spins_per_yield = 64;
  const int team_size = std::max(1, static_cast<int>(std::sqrt(impl->num_threads())));
  for (int w = 0; w < impl->num_threads(); ++w) {
    if (w % team_size == 0) impl->team_members.push_back(0);
    impl->team_of.push_back(static_cast<int>(impl->team_members.size()) - 1);
    ++impl->team_members.back();
  }
  impl->slots.reset(new Slot[kPoolQueueCapacity]);
  for (int s = 0; s < kPoolQueueCapacity; ++s) {
    impl->slots[s].counters.reset(new PaddedCounter[impl->plan.groups.size()]);
    impl->slots[s].team_arrived.reset(new PaddedCounter[impl->team_members.size()]);
  }
  try {
    for (int w = 0; w < impl->num_threads(); ++w) {
      impl->threads.emplace_back([raw = impl.get(), w, this] { raw->worker_main(w, this); });
    }
  } catch (const std::exception& e) {
    const std::string started = std::to_string(impl->threads.size());
    impl->stop.store(true);
    impl->wake_parked();
    for (std::thread& t : impl->threads) t.join();
    throw std::runtime_error("ThreadPool: could not start worker thread " + started + " of " +
                             std::to_string(impl->num_threads()) + ": " + e.what());
  }
  // Pinning is done once every worker has started: introspection right after is exact.
  const int workers = impl->num_threads();
  spin_then_yield([&] { return impl->started.load(std::memory_order_acquire) == workers; },
                  kPoolWaitSpinUs);
  impl.release();
}

ThreadPool::~ThreadPool() {
  impl_->wait_completed(impl_->published.load());
  impl_->stop.store(true);
  impl_->wake_parked();
  for (std::thread& t : impl_->threads) t.join();
  delete impl_;
}

JobHandle ThreadPool::submit(Job job) {
  for (size_t p = 0; p < job.size(); ++p) {
    if (job[p].num_tasks > 0 && !job[p].fn) {
      throw std::invalid_argument("ThreadPool::submit: phase " + std::to_string(p) + " has " +
                                  std::to_string(job[p].num_tasks) + " tasks but no function");
    }
  }
  return enqueue(std::move(job), {}, {}, {});
}

JobHandle ThreadPool::submit_built(std::function<Job()> build, std::function<void()> finish,
                                   std::function<void()> prepare) {
  if (!build) throw std::invalid_argument("ThreadPool::submit_built: build is empty");
  return enqueue({}, std::move(build), std::move(finish), std::move(prepare));
}

JobHandle ThreadPool::enqueue(Job job, std::function<Job()> build, std::function<void()> finish,
                              std::function<void()> prepare) {
  if (tl_worker_of == this) {
    throw std::logic_error("ThreadPool::submit called from inside one of its own tasks");
  }
  std::lock_guard<std::mutex> lock(impl_->submit_mu);
  const uint64_t seq = impl_->published.load(std::memory_order_relaxed);
  if (seq >= static_cast<uint64_t>(kPoolQueueCapacity)) {  // ring full: wait for its oldest job
    impl_->wait_completed(seq - kPoolQueueCapacity + 1);
  }
  Slot& slot = impl_->slots[seq % kPoolQueueCapacity];
  slot.job = std::move(job);
  slot.build = std::move(build);
  slot.finish = std::move(finish);
  slot.prepare = std::move(prepare);
  slot.build_claimed.store(false, std::memory_order_relaxed);
  slot.prepare_state.store(0, std::memory_order_relaxed);
  slot.built.store(false, std::memory_order_relaxed);
  slot.failed.store(false, std::memory_order_relaxed);
  slot.phase_gen.store(0, std::memory_order_relaxed);
  impl_->published.store(seq + 1, std::memory_order_seq_cst);
  if (impl_->parked.load(std::memory_order_seq_cst) > 0) impl_->wake_parked();
  return seq;
}

void ThreadPool::wait(JobHandle handle) {
  if (handle >= impl_->published.load(std::memory_order_acquire)) {
    throw std::invalid_argument("ThreadPool::wait: handle " + std::to_string(handle) +
                                " was never returned by submit()");
  }
  if (tl_worker_of == this) {
    throw std::logic_error("ThreadPool::wait called from inside one of its own tasks (deadlock)");
  }
  impl_->wait_completed(handle + 1);
  if (impl_->num_failures.load(std::memory_order_acquire) == 0) return;
  Failure failure;
  {
    std::lock_guard<std::mutex> lock(impl_->failures_mu);
    auto it = impl_->failures.find(handle);
    if (it == impl_->failures.end()) return;
    failure = std::move(it->second);
    impl_->failures.erase(it);
    impl_->num_failures.fetch_sub(1, std::memory_order_relaxed);
  }
  const std::string where =
      "CPU pool job " + std::to_string(handle) +
      (failure.stage ? std::string(" failed in its ") + failure.stage + " step: "
                     : " failed in phase " + std::to_string(failure.phase) + ", group " +
                           std::to_string(failure.group) + ", task " +
                           std::to_string(failure.task) + ": ");
  try {
    std::rethrow_exception(failure.error);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(where + e.what());
  } catch (const std::exception& e) {
    throw std::runtime_error(where + e.what());
  } catch (...) {
    throw std::runtime_error(where + "a non-standard exception was thrown");
  }
}

int ThreadPool::num_threads() const { return impl_->num_threads(); }
int ThreadPool::num_groups() const { return static_cast<int>(impl_->plan.groups.size()); }
int ThreadPool::group_size(int group) const { return impl_->plan.groups.at(group).size; }
int ThreadPool::group_node(int group) const { return impl_->plan.groups.at(group).node; }
int ThreadPool::worker_cpu(int worker) const { return impl_->plan.cpus.at(worker); }
int ThreadPool::pinned_threads() const { return impl_->pinned.load(); }
int ThreadPool::parked_threads() const { return impl_->parked.load(); }
bool ThreadPool::virtual_groups() const { return impl_->plan.virtual_groups; }
int ThreadPool::allowed_cpus() const { return impl_->plan.allowed_cpus; }
int ThreadPool::wait_spin_us() const { return impl_->wait_spin_us(); }

namespace {
std::atomic<ThreadPool*> g_pool{nullptr};
std::mutex g_pool_mu;
}  // namespace

ThreadPool& global_pool() {
  if (ThreadPool* pool = g_pool.load(std::memory_order_acquire)) return *pool;
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (ThreadPool* pool = g_pool.load(std::memory_order_relaxed)) return *pool;
  static bool atfork_registered = [] {
    // The child has none of the workers: forget the parent's pool (leaked, never touched again).
    pthread_atfork(nullptr, nullptr, [] {
      g_pool.store(nullptr);
      new (&g_pool_mu) std::mutex();  // it may have been held by a thread that is gone
    });
    return true;
  }();
  (void)atfork_registered;
  // Intentionally leaked: workers must outlive every static that a task might still touch.
  ThreadPool* pool = new ThreadPool();
  g_pool.store(pool, std::memory_order_release);
  return *pool;
}

}  // namespace hetmoe
