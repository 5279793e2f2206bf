#include "runtime/host_job.h"

#include <exception>
#include <stdexcept>
#include <utility>

namespace hetmoe {

HostJob::HostJob(ThreadPool& pool, std::function<Job()> make_job)
    : pool_(pool), make_job_(std::move(make_job)) {
  if (!make_job_) throw std::invalid_argument("HostJob: make_job is empty");
}

void HostJob::submit() {
  wait();
  handle_ = pool_.submit(make_job_());
  pending_.store(true, std::memory_order_release);
}

void HostJob::wait() {
  if (!pending_.exchange(false, std::memory_order_acq_rel)) return;
  pool_.wait(handle_);
}

void HostJob::submit_host_fn(void* self) {
  auto* job = static_cast<HostJob*>(self);
  try {
    job->submit();
  } catch (const std::exception& e) {
    job->keep_error(std::string("HostJob submit: ") + e.what());
  } catch (...) {
    job->keep_error("HostJob submit: a non-standard exception was thrown");
  }
}

void HostJob::wait_host_fn(void* self) {
  auto* job = static_cast<HostJob*>(self);
  try {
    job->wait();
  } catch (const std::exception& e) {
    job->keep_error(std::string("HostJob wait: ") + e.what());
  } catch (...) {
    job->keep_error("HostJob wait: a non-standard exception was thrown");
  }
}

void HostJob::launch_submit(void* stream) {
  if (int code = launch_host_func(stream, &HostJob::submit_host_fn, this)) {
    throw std::runtime_error("HostJob: cudaLaunchHostFunc(submit) failed: " +
                             cuda_error_string(code));
  }
}

void HostJob::launch_wait(void* stream) {
  if (int code = launch_host_func(stream, &HostJob::wait_host_fn, this)) {
    throw std::runtime_error("HostJob: cudaLaunchHostFunc(wait) failed: " +
                             cuda_error_string(code));
  }
}

std::string HostJob::take_error() {
  std::lock_guard<std::mutex> lock(error_mu_);
  return std::exchange(error_, std::string());
}

void HostJob::keep_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (error_.empty()) error_ = message;
}

}  // namespace hetmoe
