// The process-wide MoE scratch (workspace.h).
#include "moe/workspace.h"

#include <algorithm>
#include <cstdlib>
#include <new>

#include "layout/packed_matrix.h"

namespace hetmoe {

Workspace::~Workspace() {
  for (uint8_t* p : base) std::free(p);
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
    ws->base[r] = static_cast<uint8_t*>(std::aligned_alloc(64, ws->bytes[r]));
    if (!ws->base[r]) throw std::bad_alloc();
  }
  current = ws;
  return current;
}

}  // namespace hetmoe
