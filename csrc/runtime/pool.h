// Persistent spinning thread pool with NUMA groups and an asynchronous job queue.
//
// Contract shared by runtime/ (which implements it) and moe/ (which uses it):
// - Workers are pinned, one per core, split into `num_groups()` groups (one per NUMA node, or
//   HETMOE_NUMA_GROUPS virtual groups). By default one core is left for the caller (GPU driver).
// - A Job is a list of Phases run in order with a barrier between phases. In each phase every group
//   pulls task indices [0, num_tasks) from its own atomic counter, so skewed work balances.
// - submit() returns at once (the caller never runs tasks); wait() spins, then yields, until done.
//   Jobs submitted from any thread run one after another in submission order. Tasks must not
//   submit or wait on their own pool (std::logic_error). A task's exception skips the rest of its
//   job and is rethrown by wait() with the job, phase, group and task in the message.
// - Hot-path waits spin with `pause`; workers park only after an idle period.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
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
  // num_threads <= 0: HETMOE_THREADS, else all allowed CPUs but one (the lowest, left to the
  // caller). Workers take one CPU per physical core before any SMT sibling. num_groups <= 0:
  // HETMOE_NUMA_GROUPS, else one group per NUMA node. Throws std::invalid_argument naming the
  // argument or variable when the request cannot be met (more threads than allowed CPUs, more
  // groups than threads).
  explicit ThreadPool(int num_threads = 0, int num_groups = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Queues the job (blocks only while kPoolQueueCapacity jobs are already queued).
  JobHandle submit(Job job);
  // Queues a job whose phases are made when it starts: one worker calls `build` (which may wait,
  // e.g. for a flag a GPU writes) while the others wait for it, then every worker runs the
  // returned phases. `finish` runs once after the last phase, also when `prepare`, `build` or a
  // task threw, before wait() returns; an exception from any of them is reported by wait() like
  // a task's. `prepare` runs once before `build`, as early as the worker that built the previous
  // job is free of that (while the others still run it): work that needs no earlier job's result.
  JobHandle submit_built(std::function<Job()> build, std::function<void()> finish = {},
                         std::function<void()> prepare = {});
  // Returns once the job is done; rethrows its first task exception (std::invalid_argument stays
  // invalid_argument, others become std::runtime_error). The job's functions are destroyed by a
  // worker right after it, off the next job's path. Waiting again on a finished handle returns at
  // once; an unknown handle throws invalid_argument.
  void wait(JobHandle handle);
  void run(Job job) { wait(submit(std::move(job))); }

  int num_threads() const;
  int num_groups() const;
  int group_size(int group) const;
  int group_node(int group) const;  // NUMA node backing the group (-1 when not bound)

  // Introspection (extensions of the contract above).
  int worker_cpu(int worker) const;  // logical CPU worker `worker` is pinned to
  int pinned_threads() const;        // workers whose sched_setaffinity succeeded
  int parked_threads() const;        // workers asleep on the futex right now (idle > 50 ms)
  bool virtual_groups() const;       // groups forced by argument / HETMOE_NUMA_GROUPS
  int allowed_cpus() const;          // size of the CPU set the pool was planned from
  int wait_spin_us() const;          // kPoolWaitSpinUs; 0 when workers take every allowed CPU
                                     // (a waiter then shares a core with one, so it yields at once)

 private:
  JobHandle enqueue(Job job, std::function<Job()> build, std::function<void()> finish,
                    std::function<void()> prepare);

  struct Impl;
  Impl* impl_;
};

// Queue and spin settings, fixed at build time (reported by the introspection API).
// Queued jobs; submit() blocks beyond it. A decode step queues up to two jobs per MoE layer
// before the GPU starts it (engine/executor/overlap.py), so this bounds the layers of one step.
inline constexpr int kPoolQueueCapacity = 256;
inline constexpr int kPoolIdleBeforeParkUs = 50000;   // workers spin this long before parking
inline constexpr int kPoolWaitSpinUs = 100;           // wait() spins this long, then yields

// The process-wide pool, built on first use from HETMOE_THREADS / HETMOE_NUMA_GROUPS (throws
// std::invalid_argument on bad values). Never destroyed; a forked child builds its own.
ThreadPool& global_pool();

// Transparent huge page size: mappings from this size on are aligned to it.
inline constexpr size_t kHugePageBytes = size_t(2) << 20;

// Memory on a NUMA node: an anonymous mapping (from kHugePageBytes on: aligned to them, huge
// pages advised), placed by libnuma's numa_tonode_memory when built with it, else by an
// mbind(MPOL_PREFERRED) system call (best effort: a kernel or sandbox refusing mbind leaves it
// unbound). node < 0: no placement; a node missing from sysfs and an alignment that is not a power
// of two <= the page size throw std::invalid_argument. bytes == 0 gives nullptr. Release with
// numa_free(ptr, same bytes).
void* numa_alloc(size_t bytes, int node, size_t alignment = 64);
void numa_free(void* ptr, size_t bytes);
// Moves the pages of [ptr, ptr + bytes) (page aligned) now resident elsewhere to `node` and
// prefers it for later ones (mbind MPOL_MF_MOVE; best effort: pages other processes map stay,
// kernels without NUMA refuse). node < 0: nothing.
void numa_move(void* ptr, size_t bytes, int node);
// How numa_alloc places memory: "libnuma" or "mbind" (this build's choice).
const char* numa_memory_placement();

}  // namespace hetmoe
