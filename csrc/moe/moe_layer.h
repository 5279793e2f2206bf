// One fused MoE layer on the CPU: packed experts (split over NUMA groups along the intermediate
// dimension) and the job that computes out[q, H] = sum_j w_j * down_e(silu(gate_e x) * up_e x).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dispatch.h"
#include "layout/packed_matrix.h"
#include "runtime/pool.h"
#include "runtime/stream_flags.h"

namespace hetmoe {

enum class DType : int { kBF16 = 0, kFP32 = 1 };

struct MoECallState;  // call_state.h
struct LayerRef;      // call_state.h
struct PhaseList;     // call_job.h
struct FlaggedParts;  // flagged_job.cpp
struct PhaseClock;    // phase_clock.h

struct MoEConfig {
  int num_experts = 0;
  int hidden = 0;        // H, any size (zero-padded inside)
  int intermediate = 0;  // I, any size (zero-padded inside)
  WeightFormat format = WeightFormat::kBF16;
  int group_size = 0;    // int and fp8 formats: 32, 64, 128 or 256 (groups of the padded dims)
  Isa max_isa = Isa::kScalar;
  int amx_min_tokens = 0;  // tokens per expert from which AMX kernels are used
  // Widest gate/up task of a decode call (columns); a wider quantization group is split into
  // parts of this width so the cores get enough tasks. 32, 64 or 128.
  int decode_cols = 32;
};

// Raw pointers of one call; they must stay valid until the call's job is done.
struct MoECall {
  const void* x = nullptr;  // [q, H]
  DType x_type = DType::kFP32;
  const int64_t* ids = nullptr;     // [q, k]
  const float* weights = nullptr;   // [q, k]
  int q = 0, k = 0;
  int first_slot = 0, end_slot = -1;  // the slots of each token computed: [first, end or k)
  void* out = nullptr;              // [q, H]
  DType out_type = DType::kFP32;
};

class MoELayer {
 public:
  MoELayer(const MoEConfig& cfg, ThreadPool& pool);
  ~MoELayer();
  MoELayer(const MoELayer&) = delete;
  MoELayer& operator=(const MoELayer&) = delete;

  // gate/up: [I, H], down: [H, I], row-major. Packs (and quantizes) on the pool, each NUMA
  // group its own slice on its own node. Reloading an expert overwrites it. FP8 sources (fp8
  // format only) come with `scales`: gate's, up's and down's block scales.
  void load_expert(int e, const void* gate, const void* up, const void* down, SourceType type,
                   const BlockScales* scales = nullptr);
  // Serves every expert from the file at `path` (written by `hetmoe convert` from
  // group_memory): group g's mapping is its group_bytes(g) bytes at offsets[g] (page aligned),
  // mapped read-only in place of the layer's own memory, no copy; with `populate` the pages are
  // read in now. With several NUMA groups every page is placed now on its group's node
  // (place_mapped_pages), whatever `populate` says. The mappings live as long as the layer;
  // load_expert is refused afterwards.
  void map_file(const std::string& path, const std::vector<size_t>& offsets, bool populate);
  bool mapped() const { return mapped_; }
  // num_experts bytes, nonzero = the expert lives on the GPU (skipped here); nullptr clears.
  void set_gpu_mask(const uint8_t* mask);

  JobHandle submit(const MoECall& call);
  void wait(JobHandle handle) { pool_.wait(handle); }

  // The call that submit_flagged jobs run (buffers at fixed addresses, e.g. pinned, that a GPU
  // stream fills before it sets the ready word).
  void bind_call(const MoECall& call) { bound_call_ = call; }
  // Queues the call set by bind_call as a job a GPU stream starts and awaits through `flags`
  // (runtime/stream_flags.h): built on the pool once the ready word is set, done word set after
  // (also on failure). `flags` and this layer must outlive the job.
  // With `deferred` > 0 (Expert Deferral), the job computes each token's first k - deferred slots
  // into the call's out and sets `flags`' done word, then goes straight on to the last `deferred`
  // slots into `late_out` (same shape and dtype) and sets `late_flags`' done word (its ready word
  // is not used): the deferred experts start without a round trip through the GPU.
  JobHandle submit_flagged(StreamFlags& flags, int deferred = 0, StreamFlags* late_flags = nullptr,
                           void* late_out = nullptr);

  const MoEConfig& config() const { return cfg_; }
  // Applies to calls submitted afterwards.
  void set_amx_min_tokens(int tokens) { cfg_.amx_min_tokens = tokens; }
  // Applies to calls submitted afterwards; std::invalid_argument unless 32, 64 or 128.
  void set_decode_cols(int cols);
  // With profiling on, each call records every phase slot's first-task start and last-task end;
  // phase_us() gives the durations of the latest profiled call (after it is waited for): convert,
  // gather, gate/up, down, combine (0 for a phase the call did not run).
  // `spans` also records every task (task_spans), 32 bytes each per profiled call: off by default,
  // since the timeline keeps up to kTimelineCalls calls.
  void set_profile(bool on, bool spans = false) {
    profile_ = on;
    profile_spans_ = on && spans;
  }
  std::vector<double> phase_us() const;
  // Every task of the latest profiled call (after it is waited for; set_profile(true, true)), in
  // order of completion: [phase slot, group, worker in group, start, end], steady-clock ns.
  std::vector<std::array<int64_t, 5>> task_spans() const;
  // The profiled calls since the last take_timeline() (the first 4096), oldest first, in
  // steady-clock ns: [start, built, done, then first-task start and last-task end of each phase
  // slot (convert, gather, gate/up, down, combine; 0 when the call had no such phase)].
  // start: the ready word seen (flagged calls) or submit(); built: the job made; done: the done
  // word set (flagged) or the last task's end; then, for a flagged job's first part (else 0):
  // picked and made, the start and end of its prepare step (made before its ready word, maybe
  // while earlier jobs ran), and claimed, its build step begun (it then waits for the ready
  // word). Call it while no job of this layer runs.
  std::vector<std::vector<int64_t>> take_timeline();
  int num_groups() const { return int(slice_begin_.size()) - 1; }
  int slice_begin(int g) const { return slice_begin_[g]; }
  size_t packed_bytes() const;  // weight + scale bytes of the loaded experts
  // Group g's mapping: expert e's packed gate/up matrix at e * group_expert_bytes(g), its down
  // matrix group_down_offset(g) bytes after that (GPU prefill copies and unpacks it as is).
  const uint8_t* group_memory(int g) const { return memory_[g]; }
  size_t group_bytes(int g) const { return memory_bytes_[g]; }
  size_t group_expert_bytes(int g) const { return expert_bytes_[g]; }
  size_t group_down_offset(int g) const;

 private:
  // The job of `call` (moe_job.cpp). With `planned` (decode calls, q <= 4, whose ids and x are
  // not written yet), it is made for the most experts the call can route to and *planned gets
  // its state; bind_job() then routes it, converts the tokens and (given the job) sets the task
  // count of its gate/up + down phase to the routed experts'.
  Job make_job(const MoECall& call, std::shared_ptr<MoECallState>* planned = nullptr) const;
  void bind_job(Job* job, MoECallState& st) const;
  LayerRef layer_ref() const;
  void clock_phases(PhaseList& phases, const std::shared_ptr<MoECallState>& st) const;
  // The steps of a submit_flagged job (flagged_job.cpp).
  void prepare_flagged(FlaggedParts& fp) const;
  Job build_flagged(const std::shared_ptr<FlaggedParts>& fp) const;
  void chain_deferred(Job& job, const std::shared_ptr<FlaggedParts>& fp) const;
  void finish_flagged(FlaggedParts& fp) const;
  int slice(int g) const { return slice_begin_[g + 1] - slice_begin_[g]; }
  // The fields of group g's gate/up and down matrices of one expert (not their memory).
  void shape_expert(int g, PackedMatrix& gu, PackedMatrix& dn) const;
  // Points group g's matrices of expert e into the group's mapping.
  void place_expert(int g, int e);
  void release_memory();
  // Each NUMA group's mapping on its group's node: pages already in the page cache elsewhere
  // moved there (numa_move), then one byte of every page read by the group's own workers, so
  // a page read in now is allocated on the node that reads it (the default local policy), not
  // on the caller's, nor later by whichever thread touches it first (GPU prefill registering
  // the mapping, say).
  void place_mapped_pages();

  MoEConfig cfg_;
  ThreadPool& pool_;
  int hidden_padded_ = 0;                 // Hp: gate/up's K, H padded to 64-k blocks and groups
  int hidden_rows_ = 0;                   // down's N, H padded to whole n-blocks
  std::vector<int> slice_begin_;          // G + 1 boundaries over the padded intermediate dim
  std::vector<PackedMatrix> gate_up_;     // [G * E]: gate/up n-blocks interleaved, K = Hp
  std::vector<PackedMatrix> down_;        // [G * E]: N = H padded to 16, K = the group's slice
  std::vector<uint8_t*> memory_;          // [G]: one mapping on the group's node for all experts
  std::vector<size_t> memory_bytes_;      // [G]
  std::vector<size_t> expert_bytes_;      // [G]: one expert's gate/up + down in it
  std::vector<uint8_t> loaded_, gpu_mask_;
  bool mapped_ = false;                   // memory_ are read-only file mappings (map_file)
  bool profile_ = false;
  bool profile_spans_ = false;
  mutable std::shared_ptr<PhaseClock> last_clock_;
  mutable std::vector<std::shared_ptr<PhaseClock>> timeline_;  // profiled calls
  MoECall bound_call_;
};

// The pool for `threads` workers: 0 = the process-wide pool (from the environment); other counts
// get one shared pool each, built on first use.
ThreadPool& pool_for_threads(int threads);

}  // namespace hetmoe
