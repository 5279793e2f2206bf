// numa_alloc / numa_free: anonymous mappings placed on a NUMA node.
// With libnuma (HETMOE_HAVE_LIBNUMA) the mapping is bound by numa_tonode_memory; without it it gets
// a "preferred node" policy through the mbind system call directly, so placement still happens at
// first touch on any Linux with NUMA support. Either way the memory is an mmap region, which is why
// one numa_free (munmap) fits both. Node < 0 means "no placement".
// Mappings of 2 MiB or more start on a 2 MiB boundary and are advised as huge pages: otherwise the
// head and tail of every mapping fall back to 4 KiB pages, whose TLB misses slow the streaming
// kernels (in a VM each one is a two-level page walk).
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

// An anonymous mapping of `bytes`; from 2 MiB on, starting on a 2 MiB boundary (a larger mapping
// is trimmed: munmap of exactly [ptr, ptr + bytes) later releases all of it).
void* map_aligned(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t size = (bytes + page - 1) / page * page;
  const size_t extra = bytes >= kHugePageBytes ? kHugePageBytes : 0;
  void* raw = mmap(nullptr, size + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  if (extra == 0) return raw;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (aligned > start) munmap(raw, aligned - start);
  const size_t tail = start + size + extra - (aligned + size);
  if (tail) munmap(reinterpret_cast<void*>(aligned + size), tail);
  return reinterpret_cast<void*>(aligned);
}

void* map_on_node(size_t bytes, int node) {
  void* ptr = map_aligned(bytes);
  if (ptr == nullptr) return nullptr;
#ifdef HETMOE_HAVE_LIBNUMA
  if (node >= 0 && numa_available() >= 0) {
    numa_tonode_memory(ptr, bytes, node);
    return ptr;
  }
#endif
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
  if (bytes >= kHugePageBytes) madvise(ptr, bytes, MADV_HUGEPAGE);
  return ptr;
}

void numa_free(void* ptr, size_t bytes) {
  if (ptr != nullptr) munmap(ptr, bytes);
}

void numa_move(void* ptr, size_t bytes, int node) {
  if (ptr == nullptr || bytes == 0 || node < 0 || node >= 64) return;
  constexpr unsigned kMfMove = 1U << 1;  // MPOL_MF_MOVE from <linux/mempolicy.h>
  unsigned long mask = 1UL << node;
  // Best effort, as in map_on_node: a refusal leaves the pages where they are.
  syscall(SYS_mbind, ptr, bytes, kMpolPreferred, &mask, 64UL, kMfMove);
}

const char* numa_memory_placement() {
#ifdef HETMOE_HAVE_LIBNUMA
  return "libnuma";
#else
  return "mbind";
#endif
}

}  // namespace hetmoe
