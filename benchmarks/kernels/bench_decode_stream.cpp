// Streaming rate of the AVX-512 decode kernels alone (kernels/avx512.cpp, compiled into this
// program) on many threads: one token against packed gate/up matrices of a Qwen3-30B-A3B
// expert (N=1536, K=2048), in the decode task shape (32 intermediate columns = 4 n-blocks; 64
// = 8 for int8 groups of 64 and more), each matrix read once per pass, so the weights come from
// DRAM as in a layer call. Threads pull tasks from one counter, pinned to CPUs 1..THREADS like
// the pool's workers. FORMAT read is a plain sum of 8-byte words over the same bytes. Built and
// run by bench_decode_stream.py; prints one line of key=value pairs (best of 3 timed passes).
//
// Usage: bench_decode_stream FORMAT GROUP_SIZE THREADS GB
//   FORMAT: bf16, int8, int4, read
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/avx512.cpp"
#include "layout/packed_matrix.cpp"
#include "runtime/numa_memory.cpp"

namespace {

using hetmoe::ActView;
using hetmoe::PackedMatrix;
using hetmoe::WeightFormat;

double seconds(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s FORMAT GROUP_SIZE THREADS GB\n", argv[0]);
    return 2;
  }
  const std::string fmt = argv[1];
  const int group = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  const double gb = std::atof(argv[4]);
  PackedMatrix proto;
  proto.format = fmt == "int4" ? WeightFormat::kINT4
                 : fmt == "int8" ? WeightFormat::kINT8 : WeightFormat::kBF16;
  proto.n = 1536;
  proto.k = 2048;
  proto.group_size = proto.format == WeightFormat::kBF16 ? 0 : group;
  // One packed matrix, copied: its blocks, then the int8 scale arrays.
  const size_t blocks = proto.blocks_bytes(), scales = proto.group_floats() * sizeof(float);
  const size_t per = blocks + 2 * scales;
  const int count = std::max(1, int(gb * 1e9 / double(per)));
  const size_t total = size_t(count) * per;
  auto* arena = static_cast<uint8_t*>(mmap(nullptr, total, PROT_READ | PROT_WRITE,
                                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (arena == MAP_FAILED) return 1;
  madvise(arena, total, MADV_HUGEPAGE);  // as numa_alloc does for the weights
  std::vector<PackedMatrix> mats(count, proto);
  for (int i = 0; i < count; ++i) {
    mats[i].blocks = arena + size_t(i) * per;
    if (scales) {
      mats[i].scale = reinterpret_cast<float*>(mats[i].blocks + blocks);
      mats[i].scale_qsum = reinterpret_cast<float*>(mats[i].blocks + blocks + scales);
    }
  }
  if (fmt == "read") {
    std::memset(arena, 1, per);
  } else {
    std::vector<float> src(size_t(proto.n) * proto.k);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (float& v : src) v = normal(rng);
    hetmoe::pack_rows(mats[0], 0, proto.n / 16, src.data(), hetmoe::SourceType::kFP32,
                      proto.k, proto.n, proto.k);
  }
  for (int i = 1; i < count; ++i) std::memcpy(arena + size_t(i) * per, arena, per);
  // One token in the kernels' input form.
  const int ngroups = group ? proto.k / group : 1;
  std::vector<uint8_t> x_u8(proto.k);
  std::vector<uint16_t> x_bf16(proto.k, 0x3F80);
  std::vector<float> x_scale(ngroups, 0.01f), x_bias(ngroups, -1.0f), x_sum(ngroups, 0.5f);
  for (int i = 0; i < proto.k; ++i) x_u8[i] = uint8_t(i * 37);
  ActView a;
  a.m = 1;
  a.ld = size_t(proto.k);
  a.u8 = x_u8.data();
  a.bf16 = x_bf16.data();
  a.scale = x_scale.data();
  a.bias = x_bias.data();
  a.sum = x_sum.data();
  a.ldg = size_t(ngroups);
  const int cols = std::max(32, proto.group_size), nb_per_task = 2 * cols / 16;
  const int tasks_per_mat = proto.n / 16 / nb_per_task;
  const long tasks = long(count) * tasks_per_mat;
  const hetmoe::GemmFn gemm = hetmoe::avx512_kernels().get(proto.format);
  std::atomic<long> next{0};
  std::atomic<uint64_t> sink{0};
  std::vector<double> cpu(threads);
  auto work = [&](int t) {
    pin((t + 1) % int(std::thread::hardware_concurrency()));
    std::vector<float> c(size_t(16) * nb_per_task);
    const double start = seconds(CLOCK_THREAD_CPUTIME_ID);
    uint64_t s = 0;
    for (long task; (task = next.fetch_add(1)) < tasks;) {
      const PackedMatrix& w = mats[task / tasks_per_mat];
      const int nb = int(task % tasks_per_mat) * nb_per_task;
      if (fmt == "read") {
        const auto* p = reinterpret_cast<const uint64_t*>(w.n_block(nb));
        const size_t words = w.n_block_bytes() * nb_per_task / 8;
        for (size_t i = 0; i < words; i += 4) s += p[i] + p[i + 1] + p[i + 2] + p[i + 3];
      } else {
        gemm(w, a, nb, nb + nb_per_task, c.data(), c.size());
        s += uint64_t(c[0] != 0);
      }
    }
    cpu[t] = seconds(CLOCK_THREAD_CPUTIME_ID) - start;
    sink.fetch_add(s);
  };
  double best = 0, best_core = 0;
  for (int pass = 0; pass < 4; ++pass) {  // pass 0 warms page tables and is not counted
    next = 0;
    const double start = seconds(CLOCK_MONOTONIC);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back(work, t);
    for (std::thread& th : pool) th.join();
    const double wall = seconds(CLOCK_MONOTONIC) - start;
    const double busiest = *std::max_element(cpu.begin(), cpu.end());
    if (pass > 0) {
      best = std::max(best, double(total) / wall / 1e9);
      best_core = std::max(best_core, double(total) / busiest / 1e9 / threads);
    }
  }
  std::printf("format=%s group=%d threads=%d gb=%.2f gbs=%.1f per_core_gbs=%.2f check=%d\n",
              fmt.c_str(), proto.group_size, threads, double(total) / 1e9, best, best_core,
              int(sink.load() % 2));
  munmap(arena, total);
  return 0;
}
