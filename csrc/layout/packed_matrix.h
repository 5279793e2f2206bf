// Packed expert weights: one [N, K] projection in AMX-tile-shaped blocks, shared by every kernel.
//
// Blocks are 16 output rows (n) by a K chunk, in "VNNI" order so that a 64-byte row of a block is
// one AMX B-tile row and one AVX-512 register:
//   bf16: 16 n x 32 k, 1024 bytes, element (n, k) at [k/2][n][k%2]
//   int8: 16 n x 64 k, 1024 bytes, element (n, k) at [k/4][n][k%4]
//   int4: 16 n x 64 k,  512 bytes, the int8 block's rows r and r+8 share a byte row (low nibble r)
// Blocks run K-fastest inside an n-block, so a task that owns n-blocks streams contiguous memory.
// K is padded to a multiple of 64 with zero weights; group scales live in separate arrays.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hetmoe {

enum class WeightFormat : int { kBF16 = 0, kINT8 = 1, kINT4 = 2 };

// Source dtypes the packer reads (fp16 and fp8 are converted in Python first).
enum class SourceType : int { kBF16 = 0, kFP32 = 1 };

constexpr int kBlockN = 16;
constexpr int kPadK = 64;

inline size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

struct PackedMatrix {
  WeightFormat format = WeightFormat::kBF16;
  int n = 0;           // output rows (multiple of 16)
  int k = 0;           // input columns, padded to a multiple of 64
  int group_size = 0;  // quantization group along k (int formats)
  uint8_t* blocks = nullptr;
  // Per (n-block, group, lane) floats, n-block major: [n/16][k/group][16].
  float* scale = nullptr;      // int: w = scale * q + bias
  float* scale_qsum = nullptr; // int: scale * sum_k q over the group (activation zero-point term)
  float* bias = nullptr;       // int4 only (asymmetric groups); null for int8
  int node = -1;               // NUMA node the memory lives on

  int k_block() const { return format == WeightFormat::kBF16 ? 32 : 64; }
  size_t block_bytes() const { return format == WeightFormat::kINT4 ? 512 : 1024; }
  int num_k_blocks() const { return k / k_block(); }
  int num_groups() const { return format == WeightFormat::kBF16 ? 0 : k / group_size; }
  // First byte of n-block `nb`.
  const uint8_t* n_block(int nb) const {
    return blocks + size_t(nb) * num_k_blocks() * block_bytes();
  }
  size_t blocks_bytes() const { return size_t(n / kBlockN) * num_k_blocks() * block_bytes(); }
  size_t group_floats() const { return size_t(n) * num_groups(); }
};

// Allocates the arrays of `m` (fields n, k, group_size, format set) on NUMA node `node`.
void allocate_packed(PackedMatrix& m, int node);
void free_packed(PackedMatrix& m);

// Packs 16 * num_blocks rows of a row-major source (`src` points at the first row's first column,
// leading dimension `ld` elements) into n-blocks starting at `nb_begin`. Rows past `valid_rows` and
// columns past `valid_cols` are zero. Quantizes int formats group-wise (int8 symmetric absmax;
// int4 asymmetric with a least-squares refit, which keeps the layer error under 0.15).
void pack_rows(PackedMatrix& m, int nb_begin, int num_blocks, const void* src, SourceType type,
               size_t ld, long valid_rows, long valid_cols);

}  // namespace hetmoe
