// Scratch memory of MoE calls, shared by all layers of the process. Jobs run one after another,
// so one workspace serves every call; a call that needs more swaps in a larger one while jobs
// already queued keep theirs alive through their shared_ptr. Regions are anonymous mappings
// (runtime/pool.h numa_alloc), huge pages from 2 MiB.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

namespace hetmoe {

enum WorkspaceRegion : int {
  kTokenAct = 0,   // [q][Hp] input activations per token (bf16 or u8)
  kTokenGroups,    // [3][q][Hp / gs] int group scale / bias / sum
  kRowAct,         // [rows][Hp] gathered per expert
  kRowGroups,      // [3][rows][Hp / gs]
  kHidden,         // per NUMA group: [rows][Ig] activations of the down projection
  kHiddenGroups,   // per NUMA group: [3][rows][Ig / gs]
  kAccum,          // per NUMA group: [q][H] fp32 partial outputs
  kRowOut,         // per NUMA group: [rows][H] fp32 down outputs per row (prefill)
  kHiddenFloat,    // per NUMA group: [rows][Ig] fp32 SiLU(gate) * up (decode, groups > 64)
  kNumRegions
};

struct Workspace {
  std::array<size_t, kNumRegions> bytes{};
  std::array<uint8_t*, kNumRegions> base{};
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace();
  template <class T>
  T* at(WorkspaceRegion r, size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(base[r] + byte_offset);
  }
};

// A workspace with at least `need` bytes per region (the current one when it is large enough).
std::shared_ptr<Workspace> acquire_workspace(const std::array<size_t, kNumRegions>& need);

}  // namespace hetmoe
