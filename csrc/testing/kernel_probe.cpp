// hetmoe._cpu_kernel_testing: one AMX int4 kernel call on a matrix packed here, for the kernel
// tests (built with HETMOE_BUILD_TESTING, like _cpu_testing): the weights packed as the layer
// packs them, the rows quantized to u8 groups as its epilogue does, and the values both kernels
// multiply (dequantized weights and rows) handed back for a float64 reference.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "kernels/gemm.h"
#include "layout/packed_matrix.h"

namespace nb = nanobind;

namespace {

using hetmoe::round_up;

struct Aligned {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, Aligned>;

Buffer aligned_zeros(size_t bytes) {
  bytes = round_up(bytes, 64);
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, bytes));
  std::memset(p, 0, bytes);
  return Buffer(p);
}

double bf16(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return double(f);
}

// Weight (row, col) of int4 matrix w as its kernels multiply it: sw (q - 8) + bw of its group.
double int4_weight(const hetmoe::PackedMatrix& w, int row, int col) {
  const int nb = row / 16, lane = row % 16, r8 = col % 64 / 4;
  const uint8_t byte = w.k_block(nb, col / 64)[(r8 % 8) * 64 + lane * 4 + col % 4];
  const int q = r8 < 8 ? byte & 15 : byte >> 4;
  const uint16_t* meta = w.meta(nb, col / w.group_size);
  return bf16(meta[lane]) * (q - 8) + bf16(meta[32 + lane]);
}

// Channel `row`'s int8 grid as the i8 kernel defines it, from the group metadata.
double int4_grid(const hetmoe::PackedMatrix& w, int row) {
  double mx = 0;
  for (int g = 0; g < w.num_groups(); ++g) {
    const uint16_t* meta = w.meta(row / 16, g);
    const double s = bf16(meta[row % 16]), b = bf16(meta[32 + row % 16]);
    mx = std::max({mx, std::abs(b - 8 * s), std::abs(b + 7 * s)});
  }
  return mx / 127;
}

// A's rows (u8, mp of them, row-major ld apart) copied into the AMX tile order with tile row
// `step` bytes (ActView::tile_step).
std::vector<uint8_t> tiled(const uint8_t* u8, int mp, size_t ld, int step) {
  std::vector<uint8_t> out(size_t(mp) * ld);
  for (int r = 0; r < mp; ++r)
    for (size_t k = 0; k < ld; ++k)
      out[size_t(r / 16) * 16 * ld + k / step * 16 * step + size_t(r % 16) * step + k % step] =
          u8[size_t(r) * ld + k];
  return out;
}

// c [m, n] = x [m, k] (fp32) x w [n, k]^T (fp32, packed int4 in groups of group_size here) by
// the AMX int4 kernel `kernel` ("bf16" or "i8"), over n-blocks [0, split) and [split, end) when
// 0 < split < end (else one call); w_deq [n, k] and x_deq [m, k] (float64) get the values it
// multiplies, grid [n] (float64) each channel's largest dequantized magnitude over its groups'
// ends (q = 0 and 15) / 127. tiled: rows in tile order; stream: ActView::stream_c.
void amx_int4_gemm(const std::string& kernel, uintptr_t w_ptr, int n, int k, int group_size,
                   uintptr_t x_ptr, int m, int split, bool tiled_rows, bool stream, uintptr_t c,
                   uintptr_t w_deq, uintptr_t x_deq, uintptr_t grid) {
  if (hetmoe::best_isa() != hetmoe::Isa::kAmx)
    throw std::runtime_error("amx_int4_gemm: this CPU/build has no AMX");
  const hetmoe::GemmFn fn = kernel == "bf16" ? hetmoe::amx_gemm_int4
                            : kernel == "i8" ? hetmoe::amx_gemm_int4_i8
                                             : nullptr;
  if (!fn) throw std::invalid_argument("amx_int4_gemm: kernel '" + kernel + "': bf16 or i8");
  hetmoe::PackedMatrix w;
  w.format = hetmoe::WeightFormat::kINT4;
  w.n = int(round_up(n, 16));
  w.k = int(round_up(k, std::max(64, group_size)));
  w.group_size = group_size;
  Buffer mem = aligned_zeros(hetmoe::packed_memory_bytes(w));
  hetmoe::place_packed(w, mem.get());
  hetmoe::pack_rows(w, 0, w.n / 16, reinterpret_cast<const void*>(w_ptr),
                    hetmoe::SourceType::kFP32, size_t(k), n, k);
  const int mp = int(round_up(m, 16)), groups = w.k / group_size;
  std::vector<float> xrow(w.k), scale(size_t(mp) * groups), bias(scale.size()), sum(scale.size());
  Buffer u8 = aligned_zeros(size_t(mp) * w.k);
  const float* x = reinterpret_cast<const float*>(x_ptr);
  for (int r = 0; r < m; ++r) {
    std::memcpy(xrow.data(), x + size_t(r) * k, sizeof(float) * k);
    hetmoe::amx_kernels().epilogue.to_u8(xrow.data(), w.k, group_size, u8.get() + size_t(r) * w.k,
                                         &scale[size_t(r) * groups], &bias[size_t(r) * groups],
                                         &sum[size_t(r) * groups]);
  }
  const std::vector<uint8_t> tiles = tiled(u8.get(), mp, w.k, std::min(64, group_size));
  hetmoe::ActView a;
  a.m = m;
  a.ld = size_t(w.k);
  a.u8 = tiled_rows ? tiles.data() : u8.get();
  a.tile_step = tiled_rows ? std::min(64, group_size) : 0;
  a.scale = scale.data();
  a.bias = bias.data();
  a.sum = sum.data();
  a.ldg = size_t(groups);
  a.stream_c = stream;
  Buffer out = aligned_zeros(size_t(mp) * w.n * sizeof(float));
  float* cf = reinterpret_cast<float*>(out.get());
  const int nbs = w.n / 16;
  {
    nb::gil_scoped_release release;
    if (split > 0 && split < nbs) {
      fn(w, a, 0, split, cf, size_t(w.n));
      fn(w, a, split, nbs, cf + split * 16, size_t(w.n));
    } else {
      fn(w, a, 0, nbs, cf, size_t(w.n));
    }
  }
  auto* cd = reinterpret_cast<float*>(c);
  auto* wd = reinterpret_cast<double*>(w_deq);
  auto* xd = reinterpret_cast<double*>(x_deq);
  for (int r = 0; r < m; ++r) {
    std::memcpy(cd + size_t(r) * n, cf + size_t(r) * w.n, sizeof(float) * n);
    for (int j = 0; j < k; ++j) {
      const size_t g = size_t(r) * groups + j / group_size;
      xd[size_t(r) * k + j] = double(scale[g]) * u8.get()[size_t(r) * w.k + j] + double(bias[g]);
    }
  }
  for (int i = 0; i < n; ++i) {
    reinterpret_cast<double*>(grid)[i] = int4_grid(w, i);
    for (int j = 0; j < k; ++j) wd[size_t(i) * k + j] = int4_weight(w, i, j);
  }
}

}  // namespace

NB_MODULE(_cpu_kernel_testing, m) {
  m.def("amx_int4_gemm", &amx_int4_gemm, nb::arg("kernel"), nb::arg("w"), nb::arg("n"),
        nb::arg("k"), nb::arg("group_size"), nb::arg("x"), nb::arg("m"), nb::arg("split"),
        nb::arg("tiled"), nb::arg("stream"), nb::arg("c"), nb::arg("w_deq"), nb::arg("x_deq"),
        nb::arg("grid"),
        "One AMX int4 kernel call (raw pointers: fp32 w [n, k], x [m, k], c [m, n]; float64 "
        "w_deq [n, k], x_deq [m, k], grid [n]; checked by the caller).");
}
