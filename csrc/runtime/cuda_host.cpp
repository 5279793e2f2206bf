// Binds to the CUDA runtime the process already loaded (runtime/loaded_library.h), so nothing is
// ever loaded and the same runtime instance as torch's is used.
#include "runtime/cuda_host.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <stdexcept>

#include "runtime/loaded_library.h"

namespace hetmoe {
namespace {

using LaunchFn = int (*)(void* stream, HostFn fn, void* user_data);
using ErrorStringFn = const char* (*)(int code);

struct Runtime {
  std::atomic<LaunchFn> launch{nullptr};
  std::atomic<ErrorStringFn> error_string{nullptr};
  std::string path;  // written once, before `launch` is published
  std::mutex mu;
};

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

LaunchFn resolve() {
  Runtime& rt = runtime();
  if (LaunchFn fn = rt.launch.load(std::memory_order_acquire)) return fn;
  std::lock_guard<std::mutex> lock(rt.mu);
  if (LaunchFn fn = rt.launch.load(std::memory_order_acquire)) return fn;
  void* launch = nullptr;
  const LoadedLibrary lib = find_loaded_library("libcudart", [&](void* handle) {
    launch = dlsym(handle, "cudaLaunchHostFunc");
    return launch != nullptr;
  });
  if (lib.handle == nullptr) return nullptr;
  rt.path = lib.path;
  rt.error_string.store(reinterpret_cast<ErrorStringFn>(dlsym(lib.handle, "cudaGetErrorString")));
  rt.launch.store(reinterpret_cast<LaunchFn>(launch), std::memory_order_release);
  return reinterpret_cast<LaunchFn>(launch);
}

}  // namespace

bool cuda_host_available() { return resolve() != nullptr; }

std::string cuda_runtime_path() { return resolve() != nullptr ? runtime().path : std::string(); }

int launch_host_func(void* stream, HostFn fn, void* user_data) {
  LaunchFn launch = resolve();
  if (launch == nullptr) {
    throw std::runtime_error(
        "launch_host_func: no CUDA runtime (libcudart) is loaded in this process; initialize "
        "CUDA first (e.g. torch.cuda.init()) or use the synchronous CPU path");
  }
  if (fn == nullptr) throw std::invalid_argument("launch_host_func: fn is a null pointer");
  return launch(stream, fn, user_data);
}

std::string cuda_error_string(int code) {
  resolve();
  if (ErrorStringFn fn = runtime().error_string.load()) return fn(code);
  return "CUDA error " + std::to_string(code);
}

}  // namespace hetmoe
