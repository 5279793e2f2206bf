// CPU work that a GPU stream starts and awaits through two 32-bit words in pinned host memory,
// written and waited on by the CUDA driver's stream memory operations (cuStreamWriteValue32 /
// cuStreamWaitValue32, looked up at run time in the libcuda the process already loaded: no CUDA
// at build time). Per use, in stream order and on the CPU pool:
//   GPU stream: [inputs copied] -> ready := 1  ...  wait done == 1 -> done := 0 -> [outputs copied]
//   CPU job:    wait ready == 1 -> ready := 0 -> compute -> done := 1
// Each side clears the word it waited for, so a CUDA graph, which bakes in constant values,
// replays the protocol with no reset in between. The words must come from cudaHostAlloc (torch's
// pinned memory): under unified addressing their host address is also their device address.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace hetmoe {

// Seconds a CPU job waits for its ready word before it fails (a step whose GPU part never ran).
inline constexpr int kFlagWaitTimeoutS = 60;

class StreamFlags {
 public:
  // `ready` and `done`: 4-byte aligned words on cache lines of their own, zero at the start.
  StreamFlags(uint32_t* ready, uint32_t* done);
  StreamFlags(const StreamFlags&) = delete;
  StreamFlags& operator=(const StreamFlags&) = delete;

  // CPU side. wait_ready spins until ready == 1 and clears it (true), or until abort() (false);
  // throws std::runtime_error after kFlagWaitTimeoutS. signal_done publishes the job's writes,
  // then sets done (a release store).
  bool wait_ready();
  void signal_done();

  // GPU side: enqueue the memory operations on a CUstream / cudaStream_t (also inside CUDA graph
  // capture, as memop nodes). Throw std::runtime_error naming the CUDA error.
  void signal_ready_on(void* stream);  // ready := 1 after the stream's earlier work
  void wait_done_on(void* stream);     // wait until done == 1, then done := 0

  // Teardown of a failed step: abort() makes waiting and later wait_ready calls return false;
  // release_done() sets done again (a stream still waiting on it can run to its end); reset()
  // clears both words and the abort, once the stream is idle.
  void abort() { aborted_.store(true, std::memory_order_release); }
  void release_done();
  void reset();

  uint32_t ready() const;
  uint32_t done() const;

 private:
  uint32_t* ready_;
  uint32_t* done_;
  std::atomic<bool> aborted_{false};
};

// True when the loaded CUDA driver exports the stream memory operations (looked up again until
// found); "" or the driver library's path.
bool stream_memops_available();
std::string cuda_driver_path();

}  // namespace hetmoe
