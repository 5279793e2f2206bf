// The process-wide MoE scratch (workspace.h).
#include "moe/workspace.h"

#include <algorithm>

#include "layout/packed_matrix.h"
#include "runtime/pool.h"

namespace hetmoe {

Workspace::~Workspace() {
  for (int r = 0; r < kNumRegions; ++r) numa_free(base[r], bytes[r]);
}

std::shared_ptr<Workspace> acquire_workspace(const std::array<size_t, kNumRegions>& need) {
  static std::mutex mu;
  static std::shared_ptr<Workspace> current;
  std::lock_guard<std::mutex> lock(mu);
  bool fits = current != nullptr;
  for (int r = 0; fits && r < kNumRegions; ++r) fits = current->bytes[r] >= need[r];
  if (fits) return current;
  auto ws = std::make_shared<Workspace>();
  for (int r = 0; r < kNumRegions; ++r) {
    // Grow by half again so that slowly rising sizes do not reallocate every call.
    size_t want = std::max(need[r], current ? current->bytes[r] : 0);
    if (current && want > current->bytes[r]) want += want / 2;
    ws->bytes[r] = round_up(std::max<size_t>(want, 64), 64);
    // An anonymous mapping, from 2 MiB on advised as huge pages: prefill's gather, down and
    // combine touch rows scattered over tens of MB, where 4 KiB pages cost a TLB miss (in a VM
    // a two-level walk) every few rows. Throws std::runtime_error when it cannot map.
    ws->base[r] = static_cast<uint8_t*>(numa_alloc(ws->bytes[r], -1));
  }
  current = ws;
  return current;
}

}  // namespace hetmoe
