// StreamFlags: the CPU side spins on pinned words, the GPU side enqueues driver memops.
#include "runtime/stream_flags.h"

#include <dlfcn.h>

#include <chrono>
#include <mutex>
#include <stdexcept>

#include "runtime/loaded_library.h"
#include "runtime/spin.h"

namespace hetmoe {
namespace {

// CUresult f(CUstream, CUdeviceptr, cuuint32_t value, unsigned int flags)
using MemopFn = int (*)(void* stream, unsigned long long addr, uint32_t value, unsigned flags);
using ErrorStringFn = int (*)(int code, const char** text);

constexpr unsigned kWaitValueEq = 0x1;    // CU_STREAM_WAIT_VALUE_EQ
constexpr unsigned kWriteValueDefault = 0;  // CU_STREAM_WRITE_VALUE_DEFAULT: fenced write

struct Driver {
  std::atomic<bool> ready{false};
  MemopFn write = nullptr, wait = nullptr;
  ErrorStringFn error_string = nullptr;
  std::string path;
  std::mutex mu;
};

Driver& driver() {
  static Driver d;
  return d;
}

void* symbol(void* handle, const char* versioned, const char* plain) {
  void* fn = dlsym(handle, versioned);
  return fn != nullptr ? fn : dlsym(handle, plain);
}

const Driver* resolve() {
  Driver& d = driver();
  if (d.ready.load(std::memory_order_acquire)) return &d;
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.ready.load(std::memory_order_acquire)) return &d;
  void *write = nullptr, *wait = nullptr;
  const LoadedLibrary lib = find_loaded_library("libcuda.so", [&](void* handle) {
    write = symbol(handle, "cuStreamWriteValue32_v2", "cuStreamWriteValue32");
    wait = symbol(handle, "cuStreamWaitValue32_v2", "cuStreamWaitValue32");
    return write != nullptr && wait != nullptr;
  });
  if (lib.handle == nullptr) return nullptr;
  d.write = reinterpret_cast<MemopFn>(write);
  d.wait = reinterpret_cast<MemopFn>(wait);
  d.error_string = reinterpret_cast<ErrorStringFn>(dlsym(lib.handle, "cuGetErrorString"));
  d.path = lib.path;
  d.ready.store(true, std::memory_order_release);
  return &d;
}

const Driver& need_driver() {
  const Driver* d = resolve();
  if (d == nullptr) {
    throw std::runtime_error(
        "StreamFlags: no CUDA driver (libcuda) with cuStreamWriteValue32 is loaded in this "
        "process; initialize CUDA first (e.g. torch.cuda.init())");
  }
  return *d;
}

void check(const Driver& d, int code, const char* what) {
  if (code == 0) return;
  const char* text = nullptr;
  if (d.error_string != nullptr) d.error_string(code, &text);
  throw std::runtime_error(std::string("StreamFlags: ") + what + " failed: CUDA driver error " +
                           std::to_string(code) + (text ? std::string(" (") + text + ")" : ""));
}

unsigned long long address(uint32_t* word) { return reinterpret_cast<uintptr_t>(word); }

}  // namespace

StreamFlags::StreamFlags(uint32_t* ready, uint32_t* done) : ready_(ready), done_(done) {
  for (uint32_t* w : {ready, done}) {
    if (w == nullptr || reinterpret_cast<uintptr_t>(w) % alignof(uint32_t) != 0) {
      throw std::invalid_argument("StreamFlags: ready and done must be 4-byte aligned words");
    }
  }
  if (reinterpret_cast<uintptr_t>(ready) / kCacheLine ==
      reinterpret_cast<uintptr_t>(done) / kCacheLine) {
    throw std::invalid_argument("StreamFlags: ready and done must be on different cache lines");
  }
}

bool StreamFlags::wait_ready() {
  std::atomic_ref<uint32_t> ready(*ready_);
  auto started = std::chrono::steady_clock::now();
  for (uint32_t spins = 1;; ++spins) {
    // Acquire: the inputs the stream copied before its (fenced) write are visible after it.
    if (ready.load(std::memory_order_acquire) == 1) {
      ready.store(0, std::memory_order_relaxed);  // the stream writes it again only after done
      return true;
    }
    if (aborted_.load(std::memory_order_relaxed)) return false;
    cpu_pause();
    if (spins % (64 * kSpinsPerCheck) == 0 &&
        std::chrono::steady_clock::now() - started > std::chrono::seconds(kFlagWaitTimeoutS)) {
      throw std::runtime_error(
          "StreamFlags: the GPU stream did not signal this CPU job's inputs within " +
          std::to_string(kFlagWaitTimeoutS) + " s (was the queued step never launched?)");
    }
  }
}

void StreamFlags::signal_done() {
  std::atomic_ref<uint32_t>(*done_).store(1, std::memory_order_release);
}

void StreamFlags::release_done() { signal_done(); }

void StreamFlags::reset() {
  std::atomic_ref<uint32_t>(*ready_).store(0, std::memory_order_relaxed);
  std::atomic_ref<uint32_t>(*done_).store(0, std::memory_order_release);
  aborted_.store(false, std::memory_order_release);
}

uint32_t StreamFlags::ready() const {
  return std::atomic_ref<uint32_t>(*ready_).load(std::memory_order_acquire);
}

uint32_t StreamFlags::done() const {
  return std::atomic_ref<uint32_t>(*done_).load(std::memory_order_acquire);
}

void StreamFlags::signal_ready_on(void* stream) {
  const Driver& d = need_driver();
  check(d, d.write(stream, address(ready_), 1, kWriteValueDefault), "cuStreamWriteValue32(ready)");
}

void StreamFlags::wait_done_on(void* stream) {
  const Driver& d = need_driver();
  check(d, d.wait(stream, address(done_), 1, kWaitValueEq), "cuStreamWaitValue32(done)");
  check(d, d.write(stream, address(done_), 0, kWriteValueDefault), "cuStreamWriteValue32(done)");
}

bool stream_memops_available() { return resolve() != nullptr; }

std::string cuda_driver_path() {
  const Driver* d = resolve();
  return d != nullptr ? d->path : std::string();
}

}  // namespace hetmoe
