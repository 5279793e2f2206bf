// Where numa_alloc's pages land, for tests (hetmoe._cpu_testing).
#pragma once

#include <cstddef>
#include <vector>

namespace hetmoe {

struct NumaAllocReport {
  bool aligned = false;         // the pointer honours the requested alignment
  bool huge_page_aligned = false;  // ... and starts on a 2 MiB boundary
  std::vector<int> page_nodes;  // node of the first, middle and last page after writing them
                                // (negative: the kernel's -errno, e.g. no NUMA support)
};

// numa_alloc(bytes, node, alignment), write every byte, ask the kernel where the pages landed,
// numa_free. bytes == 0 gives a null pointer and no pages.
NumaAllocReport check_numa_alloc(size_t bytes, int node, size_t alignment);

}  // namespace hetmoe
