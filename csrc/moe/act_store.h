// Activations of the rows of one MoE call in the kernels' input form (bf16, or u8 with per-group
// scale / bias / sum arrays), as the phases of moe_job.cpp write and read them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/gemm.h"

namespace hetmoe {

// Activations of `rows` rows x `k` columns stored at `act` with group arrays [3][total][k / gs].
struct ActStore {
  uint8_t* act = nullptr;
  float* groups = nullptr;
  size_t k = 0, total = 0, ngroups = 0, elem = 0;

  ActView view(long row0, int m) const {
    ActView v;
    v.m = m;
    v.ld = k;
    if (elem == 2) v.bf16 = reinterpret_cast<const uint16_t*>(act) + row0 * k;
    else v.u8 = act + row0 * k;
    if (ngroups) {
      v.scale = groups + row0 * ngroups;
      v.bias = groups + (total + row0) * ngroups;
      v.sum = groups + (2 * total + row0) * ngroups;
      v.ldg = ngroups;
    }
    return v;
  }
  // Converts fp32 values into row `row`, columns [col, col + n) (n: whole groups).
  void put(const Epilogue& ep, long row, size_t col, const float* x, int n, int group_size) const {
    if (elem == 2) {
      ep.to_bf16(x, n, reinterpret_cast<uint16_t*>(act) + row * k + col);
      return;
    }
    const size_t g = row * ngroups + col / group_size;
    ep.to_u8(x, n, group_size, act + row * k + col, groups + g, groups + total * ngroups + g,
             groups + 2 * total * ngroups + g);
  }
  void zero(long row, size_t col, size_t n, int group_size) const {
    std::memset(act + (row * k + col) * elem, 0, n * elem);
    if (!ngroups) return;
    for (int a = 0; a < 3; ++a)
      std::memset(groups + (a * total + row) * ngroups + col / group_size, 0,
                  sizeof(float) * (n / group_size));
  }
  void copy_row(const ActStore& src, long from, long to) const {
    std::memcpy(act + to * k * elem, src.act + from * k * elem, k * elem);
    for (int a = 0; a < 3 && ngroups; ++a)
      std::memcpy(groups + (a * total + to) * ngroups,
                  src.groups + (a * src.total + from) * ngroups,
                  sizeof(float) * ngroups);
  }
};

}  // namespace hetmoe
