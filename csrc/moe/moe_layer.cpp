// MoELayer construction, NUMA slicing and parallel packing (a call's job: moe_job.cpp).
#include "moe/moe_layer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "dispatch.h"
#include "kernels/gemm.h"

namespace hetmoe {
namespace {

constexpr int kPackBlocksPerTask = 4;

// A layer that may run AMX kernels reads HETMOE_AMX_INT4 now (a bad value refused before any
// work); with "i8" an int4 layer's K (hidden for gate/up, intermediate for down, padded to
// `unit`, as the layer pads them) must fit the int8-tile kernel's int32 sums.
void check_amx_int4(const MoEConfig& cfg, int unit) {
  if (cfg.max_isa != Isa::kAmx) return;
  if (std::strcmp(amx_int4_kernel(), "i8") != 0 || cfg.format != WeightFormat::kINT4) return;
  for (const auto& [name, dim] : {std::pair{"hidden", cfg.hidden},
                                  std::pair{"intermediate", cfg.intermediate}}) {
    const long k = round_up(dim, unit);
    if (k <= kAmxInt4I8MaxK) continue;
    throw std::invalid_argument(
        "HETMOE_AMX_INT4=i8: the int8-tile int4 kernel sums at most K = " +
        std::to_string(kAmxInt4I8MaxK) + " in int32, but this layer's " + name + " " +
        std::to_string(dim) + " gives K = " + std::to_string(k) + " (a multiple of " +
        std::to_string(unit) + "); unset HETMOE_AMX_INT4 or set it to 'bf16'");
  }
}

}  // namespace

ThreadPool& pool_for_threads(int threads) {
  if (threads <= 0) return global_pool();
  static std::mutex mu;
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = pools[threads];
  if (!slot) slot = std::make_unique<ThreadPool>(threads, 0);
  return *slot;
}

MoELayer::MoELayer(const MoEConfig& cfg, ThreadPool& pool)
    : cfg_(cfg), pool_(pool) {
  const bool quantized = cfg.format != WeightFormat::kBF16;
  if (cfg.num_experts < 1 || cfg.hidden < 1 || cfg.intermediate < 1)
    throw std::invalid_argument("MoELayer: need num_experts, hidden and intermediate >= 1");
  if (quantized && (cfg.group_size < 32 || cfg.group_size > 256 ||
                    (cfg.group_size & (cfg.group_size - 1))))
    throw std::invalid_argument("MoELayer: group_size must be 32, 64, 128 or 256");
  // Any size: both input dims are zero-padded to whole 64-k blocks and quantization groups, the
  // down projection's outputs to whole n-blocks (zero weights: exact). x and out keep H columns.
  const int unit = quantized ? std::max(kPadK, cfg.group_size) : kPadK;
  check_amx_int4(cfg, unit);
  hidden_padded_ = int(round_up(cfg.hidden, unit));
  hidden_rows_ = int(round_up(cfg.hidden, kBlockN));
  // Slices are whole quantization groups and whole 64-k blocks; the tail is zero padding.
  const int units = int(round_up(cfg.intermediate, unit) / unit), groups = pool.num_groups();
  for (int g = 0; g <= groups; ++g) slice_begin_.push_back(int(long(g) * units / groups) * unit);
  gate_up_.resize(size_t(groups) * cfg.num_experts);
  down_.resize(size_t(groups) * cfg.num_experts);
  loaded_.assign(cfg.num_experts, 0);
  // One mapping per group holds its slices of every expert: one huge-page-aligned run instead of
  // a 4 KiB-paged head and tail per matrix. Only address space until experts load and touch it.
  memory_.assign(groups, nullptr);
  memory_bytes_.assign(groups, 0);
  expert_bytes_.assign(groups, 0);
  try {
    for (int g = 0; g < groups; ++g) {
      if (slice(g) == 0) continue;
      PackedMatrix gu, dn;
      shape_expert(g, gu, dn);
      expert_bytes_[g] = round_up(packed_memory_bytes(gu), 4096) +
                         round_up(packed_memory_bytes(dn), 4096);
      memory_bytes_[g] = expert_bytes_[g] * size_t(cfg.num_experts);
      memory_[g] = static_cast<uint8_t*>(numa_alloc(memory_bytes_[g], pool.group_node(g), 64));
    }
  } catch (...) {
    for (int g = 0; g < groups; ++g) numa_free(memory_[g], memory_bytes_[g]);
    throw;
  }
}

void MoELayer::shape_expert(int g, PackedMatrix& gu, PackedMatrix& dn) const {
  for (PackedMatrix* m : {&gu, &dn}) {
    m->format = cfg_.format;
    m->group_size = cfg_.group_size;
  }
  gu.n = 2 * slice(g);
  gu.k = hidden_padded_;
  dn.n = hidden_rows_;
  dn.k = slice(g);
}

MoELayer::~MoELayer() { release_memory(); }

void MoELayer::release_memory() {
  for (size_t g = 0; g < memory_.size(); ++g) {
    if (memory_[g] && mapped_) munmap(memory_[g], memory_bytes_[g]);
    if (memory_[g] && !mapped_) numa_free(memory_[g], memory_bytes_[g]);
    memory_[g] = nullptr;
  }
}

void MoELayer::place_expert(int g, int e) {
  PackedMatrix& gu = gate_up_[size_t(g) * cfg_.num_experts + e];
  PackedMatrix& dn = down_[size_t(g) * cfg_.num_experts + e];
  shape_expert(g, gu, dn);
  uint8_t* memory = memory_[g] + size_t(e) * expert_bytes_[g];
  place_packed(gu, memory);
  place_packed(dn, memory + group_down_offset(g));
}

namespace {

// Group g's bytes of the open file `fd` at `offset`, mapped read-only (checked against its size).
uint8_t* map_group(int fd, const std::string& path, int g, size_t offset, size_t bytes,
                   bool populate) {
  struct stat st {};
  if (fstat(fd, &st) != 0)
    throw std::runtime_error(path + ": cannot stat (" + std::strerror(errno) + ")");
  const size_t page = size_t(sysconf(_SC_PAGESIZE)), size = size_t(st.st_size);
  if (offset % page != 0)
    throw std::invalid_argument(path + ": group " + std::to_string(g) + " offset " +
                                std::to_string(offset) + " is not page aligned");
  if (offset + bytes > size)
    throw std::runtime_error(path + ": group " + std::to_string(g) + " needs bytes [" +
                             std::to_string(offset) + ", " + std::to_string(offset + bytes) +
                             "), the file has " + std::to_string(size) + " (truncated?)");
  void* p = mmap(nullptr, bytes, PROT_READ, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd,
                 off_t(offset));
  if (p == MAP_FAILED)
    throw std::runtime_error(path + ": mmap of group " + std::to_string(g) + " failed (" +
                             std::strerror(errno) + ")");
  madvise(p, bytes, MADV_HUGEPAGE);  // best effort: file THP only where the kernel has it
  return static_cast<uint8_t*>(p);
}

}  // namespace

void MoELayer::map_file(const std::string& path, const std::vector<size_t>& offsets,
                        bool populate) {
  const int G = num_groups();
  if (int(offsets.size()) != G)
    throw std::invalid_argument(path + ": " + std::to_string(offsets.size()) +
                                " group offsets for a layer of " + std::to_string(G) + " groups");
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(path + ": cannot open (" + std::strerror(errno) + ")");
  const bool place = G > 1 && pool_.num_groups() == G;  // MAP_POPULATE would read on this thread
  std::vector<uint8_t*> maps(G, nullptr);
  try {
    for (int g = 0; g < G; ++g)
      if (memory_bytes_[g])
        maps[g] = map_group(fd, path, g, offsets[g], memory_bytes_[g], populate && !place);
  } catch (...) {
    for (int g = 0; g < G; ++g)
      if (maps[g]) munmap(maps[g], memory_bytes_[g]);
    close(fd);
    throw;
  }
  close(fd);  // the mappings keep the file
  release_memory();
  memory_ = maps;
  mapped_ = true;
  for (int g = 0; g < G; ++g)
    for (int e = 0; slice(g) && e < cfg_.num_experts; ++e) place_expert(g, e);
  loaded_.assign(cfg_.num_experts, 1);
  if (place) place_mapped_pages();
}

void MoELayer::place_mapped_pages() {
  constexpr size_t kChunk = size_t(8) << 20;  // bytes per touching task
  const int G = num_groups();
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  size_t chunks = 0;
  for (int g = 0; g < G; ++g) chunks = std::max(chunks, (memory_bytes_[g] + kChunk - 1) / kChunk);
  Phase move{1, [this](size_t, int g, int) {
    numa_move(memory_[g], memory_bytes_[g], pool_.group_node(g));
  }};
  Phase touch{chunks, [this, page](size_t task, int g, int) {
    const size_t begin = task * kChunk, end = std::min(memory_bytes_[g], begin + kChunk);
    const volatile uint8_t* p = memory_[g];
    uint8_t sum = 0;
    for (size_t b = begin; b < end; b += page) sum = uint8_t(sum + p[b]);
    (void)sum;
  }};
  pool_.run(Job{move, touch});
}

size_t MoELayer::packed_bytes() const {
  size_t total = 0;
  for (const auto* mats : {&gate_up_, &down_})
    for (const auto& m : *mats) {
      if (m.blocks) total += m.total_bytes();
    }
  return total;
}

size_t MoELayer::group_down_offset(int g) const {
  PackedMatrix gu, dn;
  shape_expert(g, gu, dn);
  return round_up(packed_memory_bytes(gu), 4096);
}

void MoELayer::set_gpu_mask(const uint8_t* mask) {
  if (!mask) {
    gpu_mask_.clear();
    return;
  }
  gpu_mask_.assign(mask, mask + cfg_.num_experts);
}

void MoELayer::load_expert(int e, const void* gate, const void* up, const void* down,
                           SourceType type, const BlockScales* scales) {
  if (e < 0 || e >= cfg_.num_experts)
    throw std::out_of_range("load_expert: expert " + std::to_string(e) + " is out of range [0, " +
                            std::to_string(cfg_.num_experts) + ")");
  if (mapped_)
    throw std::logic_error("load_expert: this layer's experts are mapped read-only from a file");
  if ((type == SourceType::kFP8) != (scales != nullptr))
    throw std::invalid_argument("load_expert: FP8 weights come with block scales, others without");
  const int H = cfg_.hidden, I = cfg_.intermediate, G = num_groups();
  for (int g = 0; g < G; ++g) {
    if (gate_up_[size_t(g) * cfg_.num_experts + e].blocks || slice(g) == 0) continue;
    place_expert(g, e);
  }
  const BlockScales none;
  const SourceMatrix gate_src{gate, type, I, H, scales ? scales[0] : none};
  const SourceMatrix up_src{up, type, I, H, scales ? scales[1] : none};
  const SourceMatrix down_src{down, type, H, I, scales ? scales[2] : none};
  const int max_j = *std::max_element(slice_begin_.begin() + 1, slice_begin_.end()) / kBlockN;
  const int j_tasks = (max_j + kPackBlocksPerTask - 1) / kPackBlocksPerTask;
  const int d_tasks = (hidden_rows_ / kBlockN + kPackBlocksPerTask - 1) / kPackBlocksPerTask;
  Job job{Phase{size_t(j_tasks + d_tasks), [&, e](size_t task, int g, int) {
    const size_t at = size_t(g) * cfg_.num_experts + e;
    const int s0 = slice_begin_[g];
    if (int(task) < j_tasks) {
      // Gate rows of block j go to n-block 2j, up rows to 2j + 1.
      const int j_end = std::min<int>((int(task) + 1) * kPackBlocksPerTask, slice(g) / kBlockN);
      for (int j = int(task) * kPackBlocksPerTask; j < j_end; ++j) {
        const long row = s0 + long(j) * kBlockN;
        pack_source(gate_up_[at], 2 * j, 1, gate_src, row, 0);
        pack_source(gate_up_[at], 2 * j + 1, 1, up_src, row, 0);
      }
      return;
    }
    const int nb0 = (int(task) - j_tasks) * kPackBlocksPerTask;
    if (slice(g) == 0) return;
    const int count = std::min(kPackBlocksPerTask, hidden_rows_ / kBlockN - nb0);
    pack_source(down_[at], nb0, count, down_src, long(nb0) * kBlockN, s0);
  }}};
  pool_.run(std::move(job));
  loaded_[e] = 1;
}

}  // namespace hetmoe
