// The one place that knows Python. Everything else in csrc/ takes raw pointers and sizes.
#include <dlfcn.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <string>

#include "dispatch.h"
#include "moe/moe_layer.h"
#include "moe/stream_read.h"
#include "runtime/loaded_library.h"
#include "runtime/pool_probe.h"
#include "runtime/stream_flags.h"

namespace nb = nanobind;

NB_MODULE(_cpu, m) {
  m.doc() = "hetmoe CPU expert backend";
  m.def("cpu_features", [] {
    const auto& f = hetmoe::cpu_features();
    return std::map<std::string, bool>{
        {"avx2", f.avx2},
        {"fma", f.fma},
        {"f16c", f.f16c},
        {"avx512f", f.avx512f},
        {"avx512bw", f.avx512bw},
        {"avx512vl", f.avx512vl},
        {"avx512dq", f.avx512dq},
        {"avx512_bf16", f.avx512_bf16},
        {"avx512_vnni", f.avx512_vnni},
        {"amx_tile", f.amx_tile},
        {"amx_bf16", f.amx_bf16},
        {"amx_int8", f.amx_int8},
        {"amx_permitted", f.amx_permitted},
    };
  }, "CPU features this build can use here (CPUID + OS state + AMX permission).");

  // ---- runtime bindings begin ----
  // Introspection and self-checks of the CPU thread pool (pool=None: the process-wide pool).
  using hetmoe::ThreadPool;
  auto pick = [](ThreadPool* pool) -> ThreadPool& { return pool ? *pool : hetmoe::global_pool(); };
  nb::class_<ThreadPool>(m, "ThreadPool",
                         "A pinned spinning worker pool (num_threads/num_groups <= 0: from the "
                         "environment, like the process-wide pool).")
      .def(nb::init<int, int>(), nb::arg("num_threads") = 0, nb::arg("num_groups") = 0);
  m.def("pool_info", [pick](ThreadPool* pool) {
    ThreadPool& p = pick(pool);
    nb::list sizes, nodes, cpus;
    for (int g = 0; g < p.num_groups(); ++g) {
      sizes.append(p.group_size(g));
      nodes.append(p.group_node(g));
    }
    for (int w = 0; w < p.num_threads(); ++w) cpus.append(p.worker_cpu(w));
    nb::dict info;
    info["threads"] = p.num_threads();
    info["groups"] = p.num_groups();
    info["group_sizes"] = sizes;
    info["group_nodes"] = nodes;
    info["worker_cpus"] = cpus;
    info["pinned_threads"] = p.pinned_threads();
    info["parked_threads"] = p.parked_threads();
    info["virtual_groups"] = p.virtual_groups();
    info["allowed_cpus"] = p.allowed_cpus();
    info["queue_capacity"] = hetmoe::kPoolQueueCapacity;
    info["idle_before_park_us"] = hetmoe::kPoolIdleBeforeParkUs;
    info["wait_spin_us"] = p.wait_spin_us();
#ifdef HETMOE_HAVE_LIBNUMA
    info["numa_memory"] = "libnuma";
#else
    info["numa_memory"] = "mbind";
#endif
    return info;
  }, nb::arg("pool").none() = nb::none(), "Threads, groups, pinning and spin/park settings.");
  m.def("pool_run_test", [pick](int num_phases, int tasks_per_phase, int fail_phase,
                                int fail_task, ThreadPool* pool) {
    ThreadPool& p = pick(pool);
    hetmoe::CountReport r;
    {
      nb::gil_scoped_release release;
      r = hetmoe::run_count_job(p, num_phases, tasks_per_phase, fail_phase, fail_task);
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
  m.def("pool_stress", [pick](int num_jobs, int num_phases, int tasks_per_phase,
                              ThreadPool* pool) {
    ThreadPool& p = pick(pool);
    hetmoe::StressReport r;
    {
      nb::gil_scoped_release release;
      r = hetmoe::run_stress(p, num_jobs, num_phases, tasks_per_phase);
    }
    nb::dict out;
    out["jobs"] = r.num_jobs;
    out["correct"] = r.correct;
    out["in_order"] = r.in_order;
    return out;
  }, nb::arg("num_jobs"), nb::arg("num_phases"), nb::arg("tasks_per_phase"),
     nb::arg("pool").none() = nb::none(), "Queue many jobs at once; check sums and order.");
  m.def("pool_overhead_us", [pick](int iters, int tasks_per_group, int warmup,
                                   ThreadPool* pool) {
    ThreadPool& p = pick(pool);
    hetmoe::OverheadReport r;
    {
      nb::gil_scoped_release release;
      r = hetmoe::measure_overhead(p, iters, tasks_per_group, warmup);
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
  using hetmoe::StreamFlags;
  m.attr("POOL_QUEUE_CAPACITY") = hetmoe::kPoolQueueCapacity;
  m.def("stream_memops_available", &hetmoe::stream_memops_available,
        "True when the loaded CUDA driver provides cuStreamWriteValue32 / cuStreamWaitValue32.");
  m.def("cuda_driver_path", &hetmoe::cuda_driver_path,
        "The loaded CUDA driver library used for stream memory operations ('' when none).");
  m.def("loaded_library_path", [](const std::string& name_part, const std::string& symbol) {
    return hetmoe::find_loaded_library(name_part.c_str(), [&](void* handle) {
      return dlsym(handle, symbol.c_str()) != nullptr;
    }).path;
  }, nb::arg("name_part"), nb::arg("symbol"),
     "Path of an already-loaded library whose path contains name_part and that exports symbol "
     "('' when none): the lookup the CUDA driver binding uses.");
  nb::class_<StreamFlags>(m, "StreamFlags",
                          "Ready/done words in pinned memory between a GPU stream and CPU jobs "
                          "(see runtime/stream_flags.h).")
      .def("__init__", [](StreamFlags* self, uintptr_t ready, uintptr_t done) {
        new (self) StreamFlags(reinterpret_cast<uint32_t*>(ready),
                               reinterpret_cast<uint32_t*>(done));
      }, nb::arg("ready"), nb::arg("done"))
      .def("signal_ready_on", [](StreamFlags& f, uintptr_t stream) {
        f.signal_ready_on(reinterpret_cast<void*>(stream));
      }, nb::arg("stream"), "Enqueue ready := 1 on a cudaStream_t.")
      .def("wait_done_on", [](StreamFlags& f, uintptr_t stream) {
        f.wait_done_on(reinterpret_cast<void*>(stream));
      }, nb::arg("stream"), "Enqueue: wait until done == 1, then done := 0.")
      .def("abort", &StreamFlags::abort)
      .def("release_done", &StreamFlags::release_done)
      .def("reset", &StreamFlags::reset)
      .def_prop_ro("ready", &StreamFlags::ready)
      .def_prop_ro("done", &StreamFlags::done);
  using hetmoe::FlagCountJob;
  nb::class_<FlagCountJob>(m, "FlagCountJob", "A counting pool job gated by StreamFlags.")
      .def("__init__", [pick](FlagCountJob* self, StreamFlags& flags, int tasks_per_group,
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
      .def_prop_ro("saw_watch_prepared", [](FlagCountJob& j) { return j.saw_watch_prepared.load(); })
      .def("watch", [](FlagCountJob& j, FlagCountJob& other) { j.watch = &other; },
           nb::arg("other"), nb::keep_alive<1, 2>(),
           "Task 0 of each run waits (up to 2 s) until `other` was prepared.");
  // ---- runtime bindings end ----

  // ---- moe bindings begin ----
  // Raw pointers (tensor.data_ptr()) only: shapes, dtypes and contiguity are checked in Python.
  using hetmoe::MoELayer;
  m.def("best_isa", [] { return std::string(hetmoe::isa_name(hetmoe::best_isa())); },
        "The best kernel family this CPU/OS can run: amx, avx512, avx2 or scalar.");
  auto make_call = [](uintptr_t x, int x_dtype, uintptr_t ids, uintptr_t weights, int q, int k,
                      uintptr_t out, int out_dtype) {
    hetmoe::MoECall c;
    c.x = reinterpret_cast<const void*>(x);
    c.x_type = hetmoe::DType(x_dtype);
    c.ids = reinterpret_cast<const int64_t*>(ids);
    c.weights = reinterpret_cast<const float*>(weights);
    c.q = q;
    c.k = k;
    c.out = reinterpret_cast<void*>(out);
    c.out_type = hetmoe::DType(out_dtype);
    return c;
  };
  nb::class_<MoELayer>(m, "MoELayer", "Packed routed experts of one layer and their fused op.")
      .def("__init__", [](MoELayer* self, int num_experts, int hidden, int intermediate,
                          int weight_format, int group_size, const std::string& isa,
                          int amx_min_tokens, int threads) {
        hetmoe::MoEConfig cfg;
        cfg.num_experts = num_experts;
        cfg.hidden = hidden;
        cfg.intermediate = intermediate;
        cfg.format = hetmoe::WeightFormat(weight_format);
        cfg.group_size = group_size;
        cfg.max_isa = hetmoe::parse_isa(isa);
        cfg.amx_min_tokens = amx_min_tokens;
        new (self) MoELayer(cfg, hetmoe::pool_for_threads(threads));
      }, nb::arg("num_experts"), nb::arg("hidden"), nb::arg("intermediate"),
         nb::arg("weight_format"), nb::arg("group_size"), nb::arg("isa"),
         nb::arg("amx_min_tokens"), nb::arg("threads"))
      .def("load_expert", [](MoELayer& l, int e, uintptr_t gate, uintptr_t up, uintptr_t down,
                             int src_type) {
        nb::gil_scoped_release release;
        l.load_expert(e, reinterpret_cast<const void*>(gate), reinterpret_cast<const void*>(up),
                      reinterpret_cast<const void*>(down), hetmoe::SourceType(src_type));
      }, nb::arg("expert"), nb::arg("gate"), nb::arg("up"), nb::arg("down"), nb::arg("src_type"))
      .def("set_gpu_mask", [](MoELayer& l, uintptr_t mask) {
        l.set_gpu_mask(reinterpret_cast<const uint8_t*>(mask));
      }, nb::arg("mask"), "num_experts uint8 flags (0 clears the mask).")
      .def("forward", [make_call](MoELayer& l, uintptr_t x, int x_dtype, uintptr_t ids,
                                  uintptr_t weights, int q, int k, uintptr_t out, int out_dtype) {
        const hetmoe::MoECall c = make_call(x, x_dtype, ids, weights, q, k, out, out_dtype);
        nb::gil_scoped_release release;
        l.wait(l.submit(c));
      })
      .def("submit", [make_call](MoELayer& l, uintptr_t x, int x_dtype, uintptr_t ids,
                                 uintptr_t weights, int q, int k, uintptr_t out, int out_dtype) {
        const hetmoe::MoECall c = make_call(x, x_dtype, ids, weights, q, k, out, out_dtype);
        nb::gil_scoped_release release;
        return l.submit(c);
      })
      .def("wait", [](MoELayer& l, uint64_t handle) {
        nb::gil_scoped_release release;
        l.wait(handle);
      }, nb::arg("handle"))
      .def("bind_call", [make_call](MoELayer& l, uintptr_t x, int x_dtype, uintptr_t ids,
                                    uintptr_t weights, int q, int k, uintptr_t out,
                                    int out_dtype) {
        l.bind_call(make_call(x, x_dtype, ids, weights, q, k, out, out_dtype));
      }, "Fix the buffers (e.g. pinned) that submit_flagged jobs read and write.")
      .def("submit_flagged", [](MoELayer& l, hetmoe::StreamFlags& flags, int deferred,
                                hetmoe::StreamFlags* late_flags, uintptr_t late_out) {
        return l.submit_flagged(flags, deferred, late_flags, reinterpret_cast<void*>(late_out));
      }, nb::arg("flags"), nb::arg("deferred") = 0, nb::arg("late_flags").none() = nb::none(),
         nb::arg("late_out") = 0,
         "Queue the bound call, started/awaited through StreamFlags; with deferred > 0 the last "
         "`deferred` slots follow in the same job, into late_out, done on late_flags.")
      .def_prop_ro("num_groups", &MoELayer::num_groups)
      .def_prop_ro("isa", [](MoELayer& l) {
        return std::string(hetmoe::isa_name(l.config().max_isa));
      })
      .def_prop_ro("packed_bytes", &MoELayer::packed_bytes)
      .def("set_amx_min_tokens", &MoELayer::set_amx_min_tokens, nb::arg("tokens"))
      .def("set_decode_cols", &MoELayer::set_decode_cols, nb::arg("cols"),
           "Widest gate/up task of decode calls (32, 64 or 128 columns).")
      .def_prop_ro("decode_cols", [](MoELayer& l) { return l.config().decode_cols; })
      .def("set_profile", &MoELayer::set_profile, nb::arg("on"))
      .def("phase_us", &MoELayer::phase_us,
           "Per-phase microseconds of the latest profiled call (see moe_job.cpp).")
      .def("take_timeline", &MoELayer::take_timeline,
           "Profiled calls since the last take: [start, built, done, (first, last) per phase "
           "slot] in steady-clock ns (see moe_layer.h).");
  m.def("read_bandwidth", [](size_t bytes, int repeats, int threads) {
    nb::gil_scoped_release release;
    return hetmoe::read_bandwidth(hetmoe::pool_for_threads(threads), bytes, repeats);
  }, nb::arg("bytes"), nb::arg("repeats") = 5, nb::arg("threads") = 0,
     "Bytes/s of a plain read of a `bytes` buffer by the CpuMoE pool's workers (best pass).");
  // ---- moe bindings end ----
}
