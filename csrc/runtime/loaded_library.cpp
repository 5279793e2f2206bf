#include "runtime/loaded_library.h"

#include <dlfcn.h>
#include <link.h>

#include <cstring>
#include <vector>

namespace hetmoe {
namespace {

struct Search {
  const char* name_part;
  std::vector<std::string> paths;
};

int collect(dl_phdr_info* info, size_t, void* out) {
  auto* search = static_cast<Search*>(out);
  const char* name = info->dlpi_name;
  if (name != nullptr && std::strstr(name, search->name_part) != nullptr) {
    search->paths.push_back(name);
  }
  return 0;
}

}  // namespace

LoadedLibrary find_loaded_library(const char* name_part,
                                  const std::function<bool(void* handle)>& accept) {
  Search search{name_part, {}};
  dl_iterate_phdr(collect, &search);
  for (const std::string& path : search.paths) {
    // RTLD_NOLOAD: only a library that is already mapped.
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    if (accept(handle)) return {handle, path};
    dlclose(handle);
  }
  return {};
}

}  // namespace hetmoe
