// hetmoe._cpu_testing: hooks that only tests and benchmarks call (built with the CMake option
// HETMOE_BUILD_TESTING). It shares hetmoe._cpu's core library, so pool=None here is the same
// process-wide pool, and it takes _cpu's ThreadPool, StreamFlags and MoELayer objects.
#include <dlfcn.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "moe/moe_layer.h"
#include "runtime/loaded_library.h"
#include "runtime/topology.h"
#include "testing/flag_count_job.h"
#include "testing/numa_probe.h"
#include "testing/pool_probe.h"

namespace nb = nanobind;
using hetmoe::ThreadPool;

namespace {

ThreadPool& pick(ThreadPool* pool) { return pool ? *pool : hetmoe::global_pool(); }

void bind_pool_checks(nb::module_& m) {
  m.def("pool_run_test", [](int num_phases, int tasks_per_phase, int fail_phase, int fail_task,
                            ThreadPool* pool) {
    hetmoe::CountReport r;
    {
      nb::gil_scoped_release release;
      r = hetmoe::run_count_job(pick(pool), num_phases, tasks_per_phase, fail_phase, fail_task);
    }
    nb::dict out;
    out["shape"] = nb::make_tuple(r.num_phases, r.num_groups, r.tasks_per_phase);
    nb::list counts;
    for (int c : r.counts) counts.append(c);
    out["counts"] = counts;
    out["phases_ordered"] = r.phases_ordered;
    out["only_workers"] = r.only_workers;
    out["ids_valid"] = r.ids_valid;
    return out;
  }, nb::arg("num_phases"), nb::arg("tasks_per_phase"), nb::arg("fail_phase") = -1,
     nb::arg("fail_task") = 0, nb::arg("pool").none() = nb::none(),
     "Run one job; counts[(phase, group, task)] flat, phase order and caller checks.");
  m.def("pool_stress", [](int num_jobs, int num_phases, int tasks_per_phase, ThreadPool* pool) {
    hetmoe::StressReport r;
    {
      nb::gil_scoped_release release;
      r = hetmoe::run_stress(pick(pool), num_jobs, num_phases, tasks_per_phase);
    }
    nb::dict out;
    out["jobs"] = r.num_jobs;
    out["correct"] = r.correct;
    out["in_order"] = r.in_order;
    return out;
  }, nb::arg("num_jobs"), nb::arg("num_phases"), nb::arg("tasks_per_phase"),
     nb::arg("pool").none() = nb::none(), "Queue many jobs at once; check sums and order.");
}

void bind_pool_measures(nb::module_& m) {
  m.def("pool_overhead_us", [](int iters, int tasks_per_group, int warmup, ThreadPool* pool) {
    hetmoe::OverheadReport r;
    {
      nb::gil_scoped_release release;
      r = hetmoe::measure_overhead(pick(pool), iters, tasks_per_group, warmup);
    }
    nb::dict out;
    out["iters"] = r.iters;
    out["median_us"] = r.median_us;
    out["p90_us"] = r.p90_us;
    out["min_us"] = r.min_us;
    return out;
  }, nb::arg("iters"), nb::arg("tasks_per_group") = 0, nb::arg("warmup") = 200,
     nb::arg("pool").none() = nb::none(),
     "submit->wait microseconds of a prebuilt job (0 tasks: empty job) after `warmup` runs.");
  m.def("pool_plan", [](nb::list cpus, int num_threads, int num_groups) {
    std::vector<hetmoe::CpuInfo> infos;
    for (nb::handle item : cpus) {
      nb::tuple t = nb::cast<nb::tuple>(item);
      infos.push_back({nb::cast<int>(t[0]), nb::cast<int>(t[1]), nb::cast<int>(t[2])});
    }
    hetmoe::WorkerPlan plan = hetmoe::plan_workers(infos, num_threads, num_groups);
    nb::list worker_cpus, groups;
    for (int cpu : plan.cpus) worker_cpus.append(cpu);
    for (const auto& g : plan.groups) groups.append(nb::make_tuple(g.node, g.first, g.size));
    nb::dict out;
    out["worker_cpus"] = worker_cpus;
    out["groups"] = groups;
    out["virtual_groups"] = plan.virtual_groups;
    return out;
  }, nb::arg("cpus"), nb::arg("num_threads") = 0, nb::arg("num_groups") = 0,
     "The worker plan for an allowed set of (cpu, node, core) tuples: groups as "
     "(node, first worker, size). Reads HETMOE_THREADS / HETMOE_NUMA_GROUPS like the pool.");
}

void bind_memory_and_libraries(nb::module_& m) {
  m.def("numa_alloc_check", [](size_t bytes, int node, size_t alignment) {
    hetmoe::NumaAllocReport r = hetmoe::check_numa_alloc(bytes, node, alignment);
    nb::dict out;
    out["aligned"] = r.aligned;
    out["huge_page_aligned"] = r.huge_page_aligned;
    nb::list nodes;
    for (int n : r.page_nodes) nodes.append(n);
    out["page_nodes"] = nodes;
    return out;
  }, nb::arg("bytes"), nb::arg("node") = 0, nb::arg("alignment") = 64,
     "Allocate on a node, write, report where the first/middle/last pages landed, free.");
  m.def("loaded_library_path", [](const std::string& name_part, const std::string& symbol) {
    return hetmoe::find_loaded_library(name_part.c_str(), [&](void* handle) {
      return dlsym(handle, symbol.c_str()) != nullptr;
    }).path;
  }, nb::arg("name_part"), nb::arg("symbol"),
     "Path of an already-loaded library whose path contains name_part and that exports symbol "
     "('' when none): the lookup the CUDA driver binding uses.");
}

void bind_flag_count_job(nb::module_& m) {
  using hetmoe::FlagCountJob;
  nb::class_<FlagCountJob>(m, "FlagCountJob", "A counting pool job gated by StreamFlags.")
      .def("__init__", [](FlagCountJob* self, hetmoe::StreamFlags& flags, int tasks_per_group,
                          ThreadPool* pool) {
        new (self) FlagCountJob(pick(pool), flags, tasks_per_group);
      }, nb::arg("flags"), nb::arg("tasks_per_group"), nb::arg("pool").none() = nb::none(),
         nb::keep_alive<1, 2>(), nb::keep_alive<1, 4>())
      .def("submit", &FlagCountJob::submit)
      .def("wait", [](FlagCountJob& j, uint64_t handle) {
        nb::gil_scoped_release release;
        j.pool.wait(handle);
      }, nb::arg("handle"))
      .def_prop_ro("count", [](FlagCountJob& j) { return j.count.load(); })
      .def_prop_rw("fail", [](FlagCountJob& j) { return j.fail.load(); },
                   [](FlagCountJob& j, bool v) { j.fail.store(v); })
      .def_prop_rw("fail_prepare", [](FlagCountJob& j) { return j.fail_prepare.load(); },
                   [](FlagCountJob& j, bool v) { j.fail_prepare.store(v); })
      .def_prop_ro("prepared", [](FlagCountJob& j) { return j.prepared.load(); })
      .def_prop_ro("unprepared_builds", [](FlagCountJob& j) { return j.unprepared_builds.load(); })
      .def_prop_ro("saw_watch_prepared",
                   [](FlagCountJob& j) { return j.saw_watch_prepared.load(); })
      .def("watch", [](FlagCountJob& j, FlagCountJob& other) { j.watch = &other; },
           nb::arg("other"), nb::keep_alive<1, 2>(),
           "Task 0 of each run waits (up to 2 s) until `other` was prepared.");
}

// A layer's profiling and decode task width: benchmarks and tests set them, the product never.
void bind_moe_profile(nb::module_& m) {
  using hetmoe::MoELayer;
  m.def("set_decode_cols", [](MoELayer& l, int cols) { l.set_decode_cols(cols); },
        nb::arg("layer"), nb::arg("cols"),
        "Widest gate/up task of the layer's later decode calls (32, 64 or 128 columns).");
  m.def("set_profile", [](MoELayer& l, bool on, bool spans) { l.set_profile(on, spans); },
        nb::arg("layer"), nb::arg("on"), nb::arg("spans") = false,
        "Profile the layer's later calls: phase times (phase_us, take_timeline); with spans "
        "every task (task_spans).");
  m.def("phase_us", [](const MoELayer& l) { return l.phase_us(); }, nb::arg("layer"),
        "Per-phase microseconds of the layer's latest profiled call (see moe/call_plan.h).");
  m.def("task_spans", [](const MoELayer& l) { return l.task_spans(); }, nb::arg("layer"),
        "Every task of the layer's latest profiled call: [phase slot, group, worker in group, "
        "start, end] in steady-clock ns, in order of completion.");
  m.def("take_timeline", [](MoELayer& l) { return l.take_timeline(); }, nb::arg("layer"),
        "The layer's profiled calls since the last take: [start, built, done, (first, last) per "
        "phase slot] in steady-clock ns (see moe_layer.h).");
}

}  // namespace

NB_MODULE(_cpu_testing, m) {
  m.doc() = "hetmoe CPU backend: test-only hooks (pool self-checks, NUMA pages, flag jobs, "
            "MoE layer profiling)";
  nb::module_::import_("hetmoe._cpu");  // registers ThreadPool, StreamFlags and MoELayer
  bind_pool_checks(m);
  bind_pool_measures(m);
  bind_memory_and_libraries(m);
  bind_flag_count_job(m);
  bind_moe_profile(m);
}
