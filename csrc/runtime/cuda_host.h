// CUDA host functions without CUDA at build time: cudaLaunchHostFunc is looked up at run time in
// the CUDA runtime library the process already loaded (torch's), never loaded by us.
#pragma once

#include <string>

namespace hetmoe {

using HostFn = void (*)(void* user_data);  // same ABI as cudaHostFn_t

// True when a loaded CUDA runtime exports cudaLaunchHostFunc (looked up again until found).
bool cuda_host_available();

// Path of the CUDA runtime library providing cudaLaunchHostFunc, "" when none is loaded.
std::string cuda_runtime_path();

// Enqueues fn(user_data) on `stream` (a cudaStream_t; nullptr = the legacy default stream), also
// inside stream capture, where it becomes a host node of the graph. Returns the cudaError_t code
// (0 = success). Throws std::runtime_error when no CUDA runtime is loaded in this process.
int launch_host_func(void* stream, HostFn fn, void* user_data);

// cudaGetErrorString of the loaded runtime, or "CUDA error <code>" when it cannot be resolved.
std::string cuda_error_string(int code);

}  // namespace hetmoe
