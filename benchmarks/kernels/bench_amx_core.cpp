// Single-core throughput of the AMX matrix kernels alone (kernels/amx.cpp, compiled into this
// program), on the prefill task shapes of a Qwen3-30B-A3B layer: gate/up (K=2048, 32 n-blocks)
// and down (K=768, 16 n-blocks into rows 2048 floats apart), 128 rows. Weights rotate over
// `copies` packed matrices so they stream from DRAM as in a layer call. Times are on-CPU
// (CLOCK_THREAD_CPUTIME_ID), so time-sharing the core does not count. Built and run by
// bench_amx_core.py; prints one line of key=value pairs.
//
// FORMAT bf16-peak / int8-peak times the bare tile instruction instead: 2 x 2 output tiles with
// A and B in tile registers (no loads), or with `-l1`, reloaded each step from 4 KB (L1), or with
// `-l2`, each step's four tiles the next 4 KB of a 256 KB buffer (L2); M K NBLOCKS LDC COPIES
// GROUP_SIZE are then ignored and CALLS counts 64k-instruction rounds.
//
// TILED 1 hands the kernel its activations as already in tile order (ActView::tile_step, as the
// layer's prefill writes them), read in place; 0 (default) row-major, copied per call.
//
// Usage: bench_amx_core FORMAT M K NBLOCKS LDC COPIES CALLS GROUP_SIZE CPU [TILED]
//   FORMAT: bf16, int8, int4 (bf16 tiles), int4i8 (int8 tiles), bf16-peak, int8-peak, bf16-peak-l1, int8-peak-l1, bf16-peak-l2,
//           int8-peak-l2
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/amx.cpp"
#include "kernels/amx_fp8.cpp"

namespace hetmoe {
// dispatch.cpp's choice of AMX int4 kernel is not linked here: FORMAT names the kernel instead.
const char* amx_int4_kernel() { return "bf16"; }
}  // namespace hetmoe

namespace {

// Seconds for `rounds` x 16384 steps of four tdpbf16ps / tdpbusd on four C tiles, A and B
// resident (kSpan 0), or loaded every step from a buffer of kSpan bytes, walked 4 KB per step.
template <bool kInt8, size_t kSpan>
double peak(int rounds);

double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// ActView::tile_step where the kernels' tree has it (an older tree given to --kernels may not).
template <class View>
auto set_tile_step(View& v, int step, int) -> decltype(v.tile_step = step, void()) {
  v.tile_step = step;
}
template <class View>
void set_tile_step(View&, int, long) {}

void* alloc(size_t bytes) { return std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096); }

template <bool kInt8, size_t kSpan>
double peak(int rounds) {
  alignas(64) static uint8_t buf[kSpan > 4096 ? kSpan : 4096];
  for (size_t i = 0; i < sizeof(buf); ++i)
    buf[i] = uint8_t(kInt8 ? i % 61 : (i % 2 ? 0x3f : i % 97));
  hetmoe::configure(64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, buf, 64);
  _tile_loadd(5, buf + 1024, 64);
  _tile_loadd(6, buf + 2048, 64);
  _tile_loadd(7, buf + 3072, 64);
  const double t0 = cpu_seconds();
  for (int r = 0; r < rounds; ++r)
    for (int s = 0; s < 16384; ++s) {
      if (kSpan) {
        const uint8_t* p = buf + (kSpan > 4096 ? size_t(s) * 4096 % kSpan : 0);
        _tile_loadd(4, p, 64);
        _tile_loadd(6, p + 2048, 64);
        _tile_loadd(7, p + 3072, 64);
        _tile_loadd(5, p + 1024, 64);
      }
      if (kInt8) {
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
      } else {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  const double sec = cpu_seconds() - t0;
  alignas(64) static float out[256];
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0] == 12345.0f ? -sec : sec;  // keeps the loop's result alive
}

}  // namespace

int main(int argc, char** argv) {
  using namespace hetmoe;
  if (argc != 10 && argc != 11) {
    std::fprintf(stderr, "usage: %s FORMAT M K NBLOCKS LDC COPIES CALLS GROUP_SIZE CPU [TILED]\n",
                 argv[0]);
    return 2;
  }
  const bool tiled = argc == 11 && std::atoi(argv[10]) != 0;
  const std::string fmt = argv[1];
  const int m = std::atoi(argv[2]), K = std::atoi(argv[3]), nblocks = std::atoi(argv[4]);
  const size_t ldc = size_t(std::atol(argv[5]));
  const int copies = std::atoi(argv[6]), calls = std::atoi(argv[7]), gs = std::atoi(argv[8]);
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(std::atoi(argv[9]), &set);
  sched_setaffinity(0, sizeof(set), &set);
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::fprintf(stderr, "AMX permission refused\n");
    return 1;
  }
  if (fmt.find("-peak") != std::string::npos) {
    const bool int8 = fmt.rfind("int8", 0) == 0, l1 = fmt.find("-l1") != std::string::npos,
               l2 = fmt.find("-l2") != std::string::npos;
    constexpr size_t kL2 = 256 << 10;
    const double sec =
        int8 ? (l2 ? peak<true, kL2>(calls) : l1 ? peak<true, 4096>(calls) : peak<true, 0>(calls))
             : (l2 ? peak<false, kL2>(calls) : l1 ? peak<false, 4096>(calls)
                                                  : peak<false, 0>(calls));
    const double ops = 4.0 * 16384 * calls * 2 * 16 * 16 * (int8 ? 64 : 32);
    std::printf("format=%s us_per_call=%.1f tops_per_core=%.3f\n", fmt.c_str(),
                sec / calls * 1e6, ops / sec / 1e12);
    return 0;
  }
  if (fmt != "bf16" && fmt != "int8" && fmt != "int4" && fmt != "int4i8") {
    std::fprintf(stderr, "FORMAT must be bf16, int8, int4 or int4i8, got %s\n", fmt.c_str());
    return 2;
  }
  const bool i4 = fmt.rfind("int4", 0) == 0;
  const WeightFormat wf = fmt == "bf16" ? WeightFormat::kBF16
                          : i4          ? WeightFormat::kINT4
                                        : WeightFormat::kINT8;
  const bool bf = wf == WeightFormat::kBF16;
  std::mt19937 rng(1);
  std::vector<PackedMatrix> ws(copies);
  for (PackedMatrix& w : ws) {
    w.format = wf;
    w.n = nblocks * 16;
    w.k = K;
    w.group_size = bf ? 0 : gs;
    w.blocks = static_cast<uint8_t*>(alloc(w.blocks_bytes()));
    // bf16 weights in [0.5, 1) (no denormals); int8 bytes random in [0, 63].
    for (size_t i = 0; i < w.blocks_bytes() / 4; ++i)
      reinterpret_cast<uint32_t*>(w.blocks)[i] = bf ? (0x3f00u + (rng() & 0xff)) * 0x10001u
                                                    : (rng() & 0x3f3f3f3fu);
    if (i4)  // every group's metadata: scale 0.01, scale_qsum 0.1, bias -0.05 (bf16)
      for (int nb = 0; nb < nblocks; ++nb)
        for (int g = 0; g < K / gs; ++g)
          for (int l = 0; l < 16; ++l) {
            uint16_t* meta = w.meta(nb, g);
            meta[l] = 0x3c24, meta[16 + l] = 0x3dcd, meta[32 + l] = 0xbd4d;
          }
    if (wf == WeightFormat::kINT8) {
      w.scale = static_cast<float*>(alloc(w.group_floats() * 4));
      w.scale_qsum = static_cast<float*>(alloc(w.group_floats() * 4));
      for (size_t i = 0; i < w.group_floats(); ++i) w.scale[i] = 0.01f, w.scale_qsum[i] = 0.1f;
    }
  }
  const int mp = (m + 15) / 16 * 16, groups = bf ? 1 : K / gs;
  // Page-aligned like the layer's workspace (tile loads of A in place must not split lines).
  uint16_t* xb = static_cast<uint16_t*>(alloc(size_t(mp) * K * 2));
  uint8_t* xu = static_cast<uint8_t*>(alloc(size_t(mp) * K));
  for (size_t i = 0; i < size_t(mp) * K; ++i) {
    xb[i] = uint16_t(0x3f00 + (rng() & 0xff));
    xu[i] = uint8_t(rng());
  }
  std::vector<float> scale(size_t(mp) * groups, 0.02f), bias(scale.size(), -1.0f),
      sum(scale.size(), 3.0f);
  ActView a;
  a.m = m;
  a.ld = size_t(K);
  a.bf16 = xb;
  a.u8 = xu;
  a.scale = scale.data();
  a.bias = bias.data();
  a.sum = sum.data();
  a.ldg = size_t(groups);
  // The values are random either way: in place they are simply read as tiles.
  set_tile_step(a, tiled ? (bf ? 64 : std::min(64, gs)) : 0, 0);
  std::vector<float> c(size_t(mp) * ldc, -1.0f);
  const GemmFn fn = fmt == "int4i8" ? amx_gemm_int4_i8 : amx_kernels().get(wf);
  for (int r = 0; r < copies; ++r) fn(ws[r], a, 0, nblocks, c.data(), ldc);
  const double t0 = cpu_seconds();
  for (int r = 0; r < calls; ++r) fn(ws[r % copies], a, 0, nblocks, c.data(), ldc);
  const double sec = cpu_seconds() - t0;
  const double ops = 2.0 * m * K * 16 * nblocks * calls;
  std::printf("format=%s m=%d K=%d nblocks=%d gs=%d tiled=%d us_per_call=%.1f "
              "tops_per_core=%.3f weight_gbs=%.2f\n", fmt.c_str(), m, K, nblocks, bf ? 0 : gs,
              int(tiled), sec / calls * 1e6,
              ops / sec / 1e12, double(ws[0].blocks_bytes()) * calls / sec / 1e9);
  return c[0] == -1.0f ? 1 : 0;  // the kernel must have written the output
}
