// CPU topology as this process sees it (allowed CPU set, NUMA nodes, SMT siblings) and the plan
// that turns it into pinned pool workers split into groups.
#pragma once

#include <string>
#include <vector>

namespace hetmoe {

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}. Throws std::invalid_argument naming `where` on bad input.
std::vector<int> parse_cpulist(const std::string& text, const std::string& where);

struct CpuInfo {
  int cpu = 0;   // logical CPU id
  int node = -1; // NUMA node (-1: sysfs has no node information)
  int core = 0;  // physical core key: the lowest logical CPU among its SMT siblings
};

// Allowed logical CPUs (sched_getaffinity of the calling thread), in id order.
std::vector<CpuInfo> allowed_cpus();

struct WorkerGroup {
  int node = -1;   // NUMA node of all its workers (-1: mixed or unknown)
  int first = 0;   // index of its first worker
  int size = 0;    // number of workers
};

struct WorkerPlan {
  std::vector<int> cpus;            // pinned logical CPU per worker, workers of a group adjacent
  std::vector<WorkerGroup> groups;
  int allowed_cpus = 0;             // size of the allowed set the plan was made from
  bool virtual_groups = false;      // groups forced (argument / HETMOE_NUMA_GROUPS), not per node
};

// num_threads <= 0: HETMOE_THREADS, else all allowed CPUs but one (at least 1, and at least the
// forced group count when the machine has that many CPUs). num_groups <= 0: HETMOE_NUMA_GROUPS,
// else one group per NUMA node holding workers. Workers take one CPU per physical core first
// (SMT siblings only when asked for more threads than cores), spread round-robin over nodes; the
// lowest allowed CPU is the one left free for the caller. Throws std::invalid_argument with the
// offending value on a bad request or environment variable.
WorkerPlan plan_workers(const std::vector<CpuInfo>& cpus, int num_threads, int num_groups);

}  // namespace hetmoe
