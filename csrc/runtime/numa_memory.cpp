// numa_alloc / numa_free: anonymous mappings placed on a NUMA node.
// With libnuma (HETMOE_HAVE_LIBNUMA) pages come from numa_alloc_onnode; without it the mapping gets
// a "preferred node" policy through the mbind system call directly, so placement still happens at
// first touch on any Linux with NUMA support. Either way the memory is an mmap region, which is why
// one numa_free (munmap) fits both. Node < 0 means "no placement".
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "runtime/pool.h"

#ifdef HETMOE_HAVE_LIBNUMA
#include <numa.h>
#endif

namespace hetmoe {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr int kMpolPreferred = 1;  // MPOL_PREFERRED from <linux/mempolicy.h>

// Node 0 always exists (a kernel without NUMA has just that one); others must be in sysfs.
void check_node(int node) {
  if (node <= 0) return;
  struct stat st;
  std::string path = "/sys/devices/system/node/node" + std::to_string(node);
  if (stat(path.c_str(), &st) != 0) {
    throw std::invalid_argument("numa_alloc: NUMA node " + std::to_string(node) +
                                " does not exist on this machine (no " + path + ")");
  }
}

void* map_on_node(size_t bytes, int node) {
#ifdef HETMOE_HAVE_LIBNUMA
  if (node >= 0 && numa_available() >= 0) return numa_alloc_onnode(bytes, node);
#endif
  void* ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED) return nullptr;
  if (node >= 0 && node < 64) {
    unsigned long mask = 1UL << node;
    // Best effort: kernels without NUMA (or sandboxes) refuse, and then the memory is unbound.
    syscall(SYS_mbind, ptr, bytes, kMpolPreferred, &mask, 64UL, 0U);
  }
  return ptr;
}

}  // namespace

void* numa_alloc(size_t bytes, int node, size_t alignment) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > page) {
    throw std::invalid_argument(
        "numa_alloc: alignment must be a power of two up to the page size (" +
        std::to_string(page) + "), got " + std::to_string(alignment));
  }
  check_node(node);
  if (bytes == 0) return nullptr;
  void* ptr = map_on_node(bytes, node);
  if (ptr == nullptr) {
    throw std::runtime_error("numa_alloc: could not map " + std::to_string(bytes) +
                             " bytes on node " + std::to_string(node) + ": " +
                             std::strerror(errno));
  }
  // Large weight buffers: transparent huge pages cut TLB misses of the streaming kernels.
  if (bytes >= kHugePage) madvise(ptr, bytes, MADV_HUGEPAGE);
  return ptr;
}

void numa_free(void* ptr, size_t bytes) {
  if (ptr != nullptr) munmap(ptr, bytes);
}

}  // namespace hetmoe
