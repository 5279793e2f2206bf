#include "runtime/topology.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <stdexcept>
#include <utility>

namespace hetmoe {
namespace {

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (in) std::getline(in, line);
  return line;
}

int parse_int(const std::string& text, size_t& pos, const std::string& where) {
  size_t start = pos;
  while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') ++pos;
  if (pos == start || pos - start > 6) {
    throw std::invalid_argument(where + ": expected a CPU list like '0-3,8', got '" + text + "'");
  }
  return std::atoi(text.substr(start, pos - start).c_str());
}

// A positive integer from the environment, 0 when unset or empty.
int env_positive(const char* name) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || raw[0] == '\0') return 0;
  std::string value(raw);
  auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
  bool digits = value.size() <= 6 && std::all_of(value.begin(), value.end(), is_digit);
  if (!digits || std::atoi(raw) < 1) {
    throw std::invalid_argument(std::string(name) + " must be a positive integer, got '" + value +
                                "'");
  }
  return std::atoi(raw);
}

// NUMA node of every CPU listed under sysfs; empty when the kernel exposes no nodes.
std::map<int, int> node_of_cpus() {
  std::map<int, int> node_of;
  DIR* dir = opendir("/sys/devices/system/node");
  if (dir == nullptr) return node_of;
  while (dirent* entry = readdir(dir)) {
    std::string name = entry->d_name;
    if (name.rfind("node", 0) != 0 || name.size() == 4 ||
        name.find_first_not_of("0123456789", 4) != std::string::npos) {
      continue;
    }
    int node = std::atoi(name.c_str() + 4);
    std::string path = "/sys/devices/system/node/" + name + "/cpulist";
    for (int cpu : parse_cpulist(read_line(path), path)) node_of[cpu] = node;
  }
  closedir(dir);
  return node_of;
}

}  // namespace

std::vector<int> parse_cpulist(const std::string& text, const std::string& where) {
  std::vector<int> cpus;
  size_t pos = 0;
  while (pos < text.size() && text[pos] != '\n') {
    int lo = parse_int(text, pos, where);
    int hi = lo;
    if (pos < text.size() && text[pos] == '-') hi = parse_int(text, ++pos, where);
    if (hi < lo) {
      throw std::invalid_argument(where + ": descending CPU range in '" + text + "'");
    }
    for (int cpu = lo; cpu <= hi; ++cpu) cpus.push_back(cpu);
    if (pos < text.size() && text[pos] == ',') ++pos;
  }
  return cpus;
}

std::vector<CpuInfo> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) {
    throw std::runtime_error("sched_getaffinity failed: cannot read the CPUs this process may use");
  }
  std::map<int, int> node_of = node_of_cpus();
  std::vector<CpuInfo> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    CpuInfo info;
    info.cpu = cpu;
    auto it = node_of.find(cpu);
    info.node = it == node_of.end() ? -1 : it->second;
    std::string path =
        "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/thread_siblings_list";
    std::string siblings = read_line(path);
    info.core = siblings.empty() ? cpu : parse_cpulist(siblings, path).front();
    cpus.push_back(info);
  }
  return cpus;
}

namespace {

// The worker and group counts: the arguments, else the environment, else the defaults; checked
// against the `allowed` CPUs.
void resolve_counts(int allowed, int& num_threads, int& num_groups) {
  std::string threads_src = "ThreadPool(num_threads=" + std::to_string(num_threads) + ")";
  if (num_threads <= 0 && (num_threads = env_positive("HETMOE_THREADS")) > 0) {
    threads_src = "HETMOE_THREADS=" + std::to_string(num_threads);
  }
  std::string groups_src = "ThreadPool(num_groups=" + std::to_string(num_groups) + ")";
  if (num_groups <= 0 && (num_groups = env_positive("HETMOE_NUMA_GROUPS")) > 0) {
    groups_src = "HETMOE_NUMA_GROUPS=" + std::to_string(num_groups);
  }
  if (num_threads <= 0) {
    num_threads = std::max(allowed - 1, 1);
    if (num_groups > num_threads) num_threads = std::min(num_groups, allowed);
  }
  if (num_threads > allowed) {
    throw std::invalid_argument(threads_src + " asks for more worker threads than the " +
                                std::to_string(allowed) +
                                " CPUs this process may use (sched_getaffinity)");
  }
  if (num_groups > num_threads) {
    throw std::invalid_argument(groups_src + " needs at least " + std::to_string(num_groups) +
                                " worker threads, the pool has " + std::to_string(num_threads) +
                                " (set HETMOE_THREADS)");
  }
}

// Node -> CPUs in the order workers take them: one CPU per physical core first, SMT siblings
// after; with `leave_caller`, without the lowest allowed CPU (the caller keeps its whole core).
std::map<int, std::vector<int>> cpu_order(const std::vector<CpuInfo>& cpus, bool leave_caller) {
  std::map<int, std::vector<int>> primary, secondary;
  std::map<int, bool> core_seen;
  for (const CpuInfo& c : cpus) {
    (core_seen[c.core] ? secondary : primary)[c.node].push_back(c.cpu);
    core_seen[c.core] = true;
  }
  std::map<int, std::vector<int>> order;
  for (auto& [node, list] : primary) order[node] = list;
  for (auto& [node, list] : secondary) {
    order[node].insert(order[node].end(), list.begin(), list.end());
  }
  if (leave_caller) {
    auto& first = order[cpus.front().node];
    first.erase(std::find(first.begin(), first.end(), cpus.front().cpu));
  }
  return order;
}

// Node -> CPUs chosen, round-robin over the nodes (every node of `order` gets an entry).
std::map<int, std::vector<int>> take_round_robin(const std::map<int, std::vector<int>>& order,
                                                 int num_threads) {
  std::map<int, std::vector<int>> taken;
  for (int picked = 0; picked < num_threads;) {
    for (auto& [node, list] : order) {
      size_t next = taken[node].size();
      if (picked < num_threads && next < list.size()) {
        taken[node].push_back(list[next]);
        ++picked;
      }
    }
  }
  return taken;
}

// Forced groups: each node's workers are split when the groups divide evenly over the nodes (and
// each node has enough workers), so no group straddles two nodes; else all workers as one range.
void split_virtual_groups(WorkerPlan& plan, const std::map<int, std::vector<int>>& taken,
                          const std::vector<int>& node_of_worker, int num_groups,
                          int num_threads) {
  plan.virtual_groups = true;
  std::vector<std::pair<int, int>> ranges;  // (first worker, count)
  const int nodes = static_cast<int>(taken.size());
  bool per_node = num_groups % nodes == 0;
  for (auto& [node, list] : taken) {
    per_node = per_node && static_cast<int>(list.size()) >= num_groups / nodes;
  }
  if (per_node) {
    int first = 0;
    for (auto& [node, list] : taken) {
      ranges.push_back({first, static_cast<int>(list.size())});
      first += static_cast<int>(list.size());
    }
  } else {
    ranges.push_back({0, num_threads});
  }
  const int per_range = num_groups / static_cast<int>(ranges.size());
  for (auto [first, count] : ranges) {
    for (int g = 0; g < per_range; ++g) {  // chunks whose sizes differ by at most one
      int size = count / per_range + (g < count % per_range ? 1 : 0);
      int node = node_of_worker[first];
      for (int w = first; w < first + size; ++w) {
        if (node_of_worker[w] != node) node = -1;
      }
      plan.groups.push_back({node, first, size});
      first += size;
    }
  }
}

}  // namespace

WorkerPlan plan_workers(const std::vector<CpuInfo>& cpus, int num_threads, int num_groups) {
  const int allowed = static_cast<int>(cpus.size());
  resolve_counts(allowed, num_threads, num_groups);
  const std::map<int, std::vector<int>> order = cpu_order(cpus, num_threads < allowed);
  const std::map<int, std::vector<int>> taken = take_round_robin(order, num_threads);

  WorkerPlan plan;
  plan.allowed_cpus = allowed;
  std::vector<int> node_of_worker;
  for (auto& [node, list] : taken) {
    if (list.empty()) continue;
    if (num_groups <= 0) {
      plan.groups.push_back(
          {node, static_cast<int>(plan.cpus.size()), static_cast<int>(list.size())});
    }
    for (int cpu : list) {
      plan.cpus.push_back(cpu);
      node_of_worker.push_back(node);
    }
  }
  if (num_groups > 0) split_virtual_groups(plan, taken, node_of_worker, num_groups, num_threads);
  return plan;
}

}  // namespace hetmoe
