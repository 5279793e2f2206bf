// The reference for "memory-bound": a plain read of a large buffer by the pool's workers.
#pragma once

#include <cstddef>

#include "runtime/pool.h"

namespace hetmoe {

// Best bytes/s of `repeats` passes over a `bytes` buffer, each worker pulling 1 MiB chunks.
double read_bandwidth(ThreadPool& pool, size_t bytes, int repeats);

}  // namespace hetmoe
