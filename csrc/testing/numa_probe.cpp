#include "testing/numa_probe.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "runtime/pool.h"

namespace hetmoe {

NumaAllocReport check_numa_alloc(size_t bytes, int node, size_t alignment) {
  NumaAllocReport report;
  auto* ptr = static_cast<unsigned char*>(numa_alloc(bytes, node, alignment));
  report.aligned = reinterpret_cast<uintptr_t>(ptr) % alignment == 0;
  report.huge_page_aligned = reinterpret_cast<uintptr_t>(ptr) % kHugePageBytes == 0;
  if (ptr == nullptr) return report;
  std::fill(ptr, ptr + bytes, static_cast<unsigned char>(0x5a));
  void* pages[3] = {ptr, ptr + bytes / 2, ptr + bytes - 1};
  int status[3] = {0, 0, 0};
  // move_pages with no target nodes only reports where each page lives.
  syscall(SYS_move_pages, 0, 3UL, pages, nullptr, status, 0);
  report.page_nodes.assign(status, status + 3);
  numa_free(ptr, bytes);
  return report;
}

}  // namespace hetmoe
