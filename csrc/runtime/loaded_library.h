// Binding to a shared library the process already loaded (torch's CUDA driver, for
// runtime/stream_flags.h), without linking or loading it ourselves.
#pragma once

#include <functional>
#include <string>

namespace hetmoe {

struct LoadedLibrary {
  void* handle = nullptr;  // from dlopen(RTLD_NOLOAD); kept open, so the library stays mapped
  std::string path;
};

// The first object mapped into the process (dl_iterate_phdr order) whose path contains
// `name_part` and for which `accept(handle)` is true (e.g. it exports the symbols the caller
// needs, which `accept` may also store). {nullptr, ""} when none.
LoadedLibrary find_loaded_library(const char* name_part,
                                  const std::function<bool(void* handle)>& accept);

}  // namespace hetmoe
