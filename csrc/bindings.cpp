// The one place that knows Python (hetmoe._cpu; test-only hooks are in testing/, module
// hetmoe._cpu_testing). Everything else in csrc/ takes raw pointers and sizes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <string>

#include "dispatch.h"
#include "moe/backward_job.h"
#include "moe/moe_layer.h"
#include "moe/stream_read.h"
#include "runtime/pool.h"
#include "runtime/stream_flags.h"

namespace nb = nanobind;
using hetmoe::MoELayer;
using hetmoe::StreamFlags;
using hetmoe::ThreadPool;

namespace {

void bind_cpu(nb::module_& m) {
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
        {"avx512_vbmi", f.avx512_vbmi},
        {"amx_tile", f.amx_tile},
        {"amx_bf16", f.amx_bf16},
        {"amx_int8", f.amx_int8},
        {"amx_permitted", f.amx_permitted},
    };
  }, "CPU features this build can use here (CPUID + OS state + AMX permission).");
  m.def("best_isa", [] { return std::string(hetmoe::isa_name(hetmoe::best_isa())); },
        "The best kernel family this CPU/OS can run: amx, avx512, avx2 or scalar.");
  m.def("resolve_isa", [](const std::string& name) {
    return std::string(hetmoe::isa_name(hetmoe::parse_isa(name)));
  }, "The kernel family a layer capped at `name` (auto, amx, avx512, avx2, scalar) runs here, as "
     "CpuMoE resolves it (ValueError for an unknown name or one this CPU/OS lacks).");
  m.def("amx_int4_kernel", [] { return std::string(hetmoe::amx_int4_kernel()); },
        "The AMX int4 kernel: 'bf16' (bf16 tiles, the default) or 'i8' (int8 tiles), from "
        "HETMOE_AMX_INT4 (ValueError naming it for any other value).");
#ifdef HETMOE_AMX_EMULATION
  m.attr("AMX_EMULATION") = true;  // CMakeLists.txt: AMX in plain C++, a developer build
#else
  m.attr("AMX_EMULATION") = false;
#endif
}

// The CPU thread pool and its introspection (pool=None: the process-wide pool).
void bind_pool(nb::module_& m) {
  nb::class_<ThreadPool>(m, "ThreadPool",
                         "A pinned spinning worker pool (num_threads/num_groups <= 0: from the "
                         "environment, like the process-wide pool).")
      .def(nb::init<int, int>(), nb::arg("num_threads") = 0, nb::arg("num_groups") = 0);
  m.attr("POOL_QUEUE_CAPACITY") = hetmoe::kPoolQueueCapacity;
  m.def("pool_info", [](ThreadPool* pool) {
    ThreadPool& p = pool ? *pool : hetmoe::global_pool();
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
    info["numa_memory"] = hetmoe::numa_memory_placement();
    return info;
  }, nb::arg("pool").none() = nb::none(), "Threads, groups, pinning and spin/park settings.");
}

void bind_stream_flags(nb::module_& m) {
  m.def("stream_memops_available", &hetmoe::stream_memops_available,
        "True when the loaded CUDA driver provides cuStreamWriteValue32 / cuStreamWaitValue32.");
  m.def("cuda_driver_path", &hetmoe::cuda_driver_path,
        "The loaded CUDA driver library used for stream memory operations ('' when none).");
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
}

// Raw pointers (tensor.data_ptr()) only: shapes, dtypes and contiguity are checked in Python.
// The routing fields a forward call (MoECall) and a backward call (MoEGradCall) share.
template <class Call>
Call routed_call(uintptr_t x, int x_dtype, uintptr_t ids, uintptr_t weights, int q, int k) {
  Call c;
  c.x = reinterpret_cast<const void*>(x);
  c.x_type = hetmoe::DType(x_dtype);
  c.ids = reinterpret_cast<const int64_t*>(ids);
  c.weights = reinterpret_cast<const float*>(weights);
  c.q = q;
  c.k = k;
  return c;
}

hetmoe::MoECall make_call(uintptr_t x, int x_dtype, uintptr_t ids, uintptr_t weights, int q,
                          int k, uintptr_t out, int out_dtype) {
  auto c = routed_call<hetmoe::MoECall>(x, x_dtype, ids, weights, q, k);
  c.out = reinterpret_cast<void*>(out);
  c.out_type = hetmoe::DType(out_dtype);
  return c;
}

void bind_moe_weights(nb::class_<MoELayer>& layer) {
  layer.def("__init__", [](MoELayer* self, int num_experts, int hidden, int intermediate,
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
      .def("load_expert_fp8", [](MoELayer& l, int e, uintptr_t gate, uintptr_t up, uintptr_t down,
                                 std::array<uintptr_t, 3> scales, int block_n, int block_k) {
        // Contiguous e4m3 codes and fp32 scales [ceil(rows / block_n), ceil(cols / block_k)].
        nb::gil_scoped_release release;
        const int H = l.config().hidden, I = l.config().intermediate;
        const int cols[3] = {H, H, I};
        hetmoe::BlockScales s[3];
        for (int i = 0; i < 3; ++i)
          s[i] = {reinterpret_cast<const float*>(scales[i]), block_n, block_k,
                  size_t((cols[i] + block_k - 1) / block_k)};
        l.load_expert(e, reinterpret_cast<const void*>(gate), reinterpret_cast<const void*>(up),
                      reinterpret_cast<const void*>(down), hetmoe::SourceType::kFP8, s);
      }, nb::arg("expert"), nb::arg("gate"), nb::arg("up"), nb::arg("down"), nb::arg("scales"),
         nb::arg("block_n"), nb::arg("block_k"))
      .def("map_file", [](MoELayer& l, const std::string& path, std::vector<size_t> offsets,
                          bool populate) {
        nb::gil_scoped_release release;
        l.map_file(path, offsets, populate);
      }, nb::arg("path"), nb::arg("offsets"), nb::arg("populate"),
         "Serve the experts from read-only mappings of the file (group g at offsets[g]).")
      .def_prop_ro("mapped", &MoELayer::mapped)
      .def("set_gpu_mask", [](MoELayer& l, uintptr_t mask) {
        l.set_gpu_mask(reinterpret_cast<const uint8_t*>(mask));
      }, nb::arg("mask"), "num_experts uint8 flags (0 clears the mask).")
      .def_prop_ro("num_groups", &MoELayer::num_groups)
      .def_prop_ro("isa", [](MoELayer& l) {
        return std::string(hetmoe::isa_name(l.config().max_isa));
      })
      .def_prop_ro("packed_bytes", &MoELayer::packed_bytes)
      .def("group_memory", [](MoELayer& l, int g) {
        if (g < 0 || g >= l.num_groups()) throw nb::index_error("group_memory: no such group");
        return nb::make_tuple(reinterpret_cast<uintptr_t>(l.group_memory(g)), l.group_bytes(g),
                              l.group_expert_bytes(g), l.group_down_offset(g), l.slice_begin(g),
                              l.slice_begin(g + 1));
      }, nb::arg("group"),
         "(address, bytes, bytes per expert, down matrix offset in an expert, slice begin, "
         "slice end) of group g's packed experts.");
}

void bind_moe_calls(nb::class_<MoELayer>& layer) {
  layer.def("forward", [](MoELayer& l, uintptr_t x, int x_dtype, uintptr_t ids,
                          uintptr_t weights, int q, int k, uintptr_t out, int out_dtype) {
         const hetmoe::MoECall c = make_call(x, x_dtype, ids, weights, q, k, out, out_dtype);
         nb::gil_scoped_release release;
         l.wait(l.submit(c));
       })
      .def("submit", [](MoELayer& l, uintptr_t x, int x_dtype, uintptr_t ids, uintptr_t weights,
                        int q, int k, uintptr_t out, int out_dtype) {
        const hetmoe::MoECall c = make_call(x, x_dtype, ids, weights, q, k, out, out_dtype);
        nb::gil_scoped_release release;
        return l.submit(c);
      })
      .def("wait", [](MoELayer& l, uint64_t handle) {
        nb::gil_scoped_release release;
        l.wait(handle);
      }, nb::arg("handle"))
      .def("bind_call", [](MoELayer& l, uintptr_t x, int x_dtype, uintptr_t ids,
                           uintptr_t weights, int q, int k, uintptr_t out, int out_dtype) {
        l.bind_call(make_call(x, x_dtype, ids, weights, q, k, out, out_dtype));
      }, "Fix the buffers (e.g. pinned) that submit_flagged jobs read and write.")
      .def("submit_flagged", [](MoELayer& l, StreamFlags& flags, int deferred,
                                StreamFlags* late_flags, uintptr_t late_out) {
        return l.submit_flagged(flags, deferred, late_flags, reinterpret_cast<void*>(late_out));
      }, nb::arg("flags"), nb::arg("deferred") = 0, nb::arg("late_flags").none() = nb::none(),
         nb::arg("late_out") = 0,
         "Queue the bound call, started/awaited through StreamFlags; with deferred > 0 the last "
         "`deferred` slots follow in the same job, into late_out, done on late_flags.");
}

void bind_moe_settings(nb::class_<MoELayer>& layer) {
  // Profiling and the decode task width: _cpu_testing's (csrc/testing), no product code sets them.
  layer.def("set_amx_min_tokens", &MoELayer::set_amx_min_tokens, nb::arg("tokens"))
      .def_prop_ro("decode_cols", [](MoELayer& l) { return l.config().decode_cols; });
}

void bind_moe_backward(nb::class_<MoELayer>& layer) {
  layer.def("backward", [](MoELayer& l, uintptr_t x, int x_dtype, uintptr_t ids,
                           uintptr_t weights, int q, int k, uintptr_t dy, uintptr_t dx,
                           uintptr_t dweights, uintptr_t out, uintptr_t gpu_mask,
                           uintptr_t loaded, int threads, bool bf16_math) {
    auto c = routed_call<hetmoe::MoEGradCall>(x, x_dtype, ids, weights, q, k);
    c.dy = reinterpret_cast<const float*>(dy);
    c.dx = reinterpret_cast<float*>(dx);
    c.dweights = reinterpret_cast<float*>(dweights);
    c.out = reinterpret_cast<float*>(out);
    c.gpu_mask = reinterpret_cast<const uint8_t*>(gpu_mask);
    c.loaded = reinterpret_cast<const uint8_t*>(loaded);
    c.bf16_math = bf16_math;
    nb::gil_scoped_release release;
    hetmoe::moe_backward(l, hetmoe::pool_for_threads(threads), c);
  }, "Routed experts' backward (moe/backward_job.h): dx [q, H] and dweights [q, k] (fp32) "
     "from x, ids, weights and dy [q, H] fp32 (0: none); out [q, H] fp32 (0: none) the fp32 "
     "forward; gpu_mask 0 = none, loaded: E uint8 flags; bf16_math: the forward's bf16 / AMX "
     "kernels (backward_job.h).");
}

void bind_moe(nb::module_& m) {
  nb::class_<MoELayer> layer(m, "MoELayer",
                             "Packed routed experts of one layer and their fused op.");
  bind_moe_weights(layer);
  bind_moe_calls(layer);
  bind_moe_settings(layer);
  bind_moe_backward(layer);
  m.def("read_bandwidth", [](size_t bytes, int repeats, int threads) {
    nb::gil_scoped_release release;
    return hetmoe::read_bandwidth(hetmoe::pool_for_threads(threads), bytes, repeats);
  }, nb::arg("bytes"), nb::arg("repeats") = 5, nb::arg("threads") = 0,
     "Bytes/s of a plain read of a `bytes` buffer by the CpuMoE pool's workers (best pass).");
}

}  // namespace

NB_MODULE(_cpu, m) {
  m.doc() = "hetmoe CPU expert backend";
  bind_cpu(m);
  bind_pool(m);
  bind_stream_flags(m);
  bind_moe(m);
}
