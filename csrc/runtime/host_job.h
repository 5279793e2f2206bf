// A pool job that a CUDA stream starts and finishes through host functions, so a captured CUDA
// graph can run CPU work in stream order: [GPU writes inputs] -> submit -> [GPU work] -> wait.
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <string>

#include "runtime/cuda_host.h"
#include "runtime/pool.h"

namespace hetmoe {

class HostJob {
 public:
  // `make_job` builds the job at each submit, from state the owner keeps at fixed addresses
  // (e.g. pinned buffers the GPU filled earlier in the stream). The pool must outlive this object.
  HostJob(ThreadPool& pool, std::function<Job()> make_job);
  HostJob(const HostJob&) = delete;
  HostJob& operator=(const HostJob&) = delete;

  void submit();  // builds and submits a job (waiting first for a still-pending one)
  void wait();    // waits the pending job; no-op when none

  // C entry points for cudaLaunchHostFunc; user_data is the HostJob*. They never throw (the CUDA
  // callback thread cannot take exceptions): a failure is kept for take_error().
  static void submit_host_fn(void* self);
  static void wait_host_fn(void* self);

  // Enqueue submit / wait on a cudaStream_t; throw std::runtime_error on a CUDA error.
  void launch_submit(void* stream);
  void launch_wait(void* stream);

  // The first error kept since the last call ("" when none), e.g. after a stream synchronize.
  std::string take_error();

 private:
  void keep_error(const std::string& message);

  ThreadPool& pool_;
  std::function<Job()> make_job_;
  std::atomic<bool> pending_{false};
  JobHandle handle_ = 0;
  std::mutex error_mu_;
  std::string error_;
};

}  // namespace hetmoe
