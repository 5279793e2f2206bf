// Packed expert weights: one [N, K] projection in AMX-tile-shaped blocks, shared by every kernel.
//
// Blocks are 16 output rows (n) by a K chunk, in "VNNI" order so that a 64-byte row of a block is
// one AMX B-tile row and one AVX-512 register:
//   bf16: 16 n x 32 k, 1024 bytes, element (n, k) at [k/2][n][k%2]
//   int8: 16 n x 64 k, 1024 bytes, element (n, k) at [k/4][n][k%4]
//   int4: 16 n x 64 k,  512 bytes, the int8 block's rows r and r+8 share a byte row (low nibble r)
//   fp8:  16 n x 64 k, 1024 bytes, e4m3 codes, element (n, k) at [k/2][n][k%2] (the bf16 order with
//         one byte per value: an n-block is [K/2][16][2] bytes, widened in place to bf16 tiles)
// Blocks run K-fastest inside an n-block, so a task that owns n-blocks streams contiguous memory.
// K is padded to a multiple of 64 with zero weights. Int8 group scales live in separate fp32
// arrays; so do fp8's (one array: the checkpoint's block scale per (n, group), w = scale * e4m3).
// Int4 keeps them inline as bf16: an n-block is a series of runs of max(64, group) k,
// each its 512-byte blocks followed by its groups' metadata (per group scale[16], scale_qsum[16],
// bias[16] in bf16, 96 bytes; a run's metadata padded to 64 bytes), so decode streams one run of
// memory per task and reads 6 instead of 12 metadata bytes per group and lane.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hetmoe {

enum class WeightFormat : int { kBF16 = 0, kINT8 = 1, kINT4 = 2, kFP8 = 3 };

// Formats whose kernels take u8 activations quantized per group (the others take bf16 rows).
inline bool u8_activations(WeightFormat f) {
  return f == WeightFormat::kINT8 || f == WeightFormat::kINT4;
}

// Source dtypes the packer reads (fp16 is converted in Python first). FP8 (e4m3 codes with
// block scales) packs only into the fp8 format, which takes nothing else.
enum class SourceType : int { kBF16 = 0, kFP32 = 1, kFP8 = 2 };

// The block scales of an FP8 source matrix [rows, cols]: fp32 [ceil(rows / block_n)][ld], the
// scale of element (r, c) at [r / block_n][c / block_k] (DeepSeek-V3's weight_scale_inv).
struct BlockScales {
  const float* data = nullptr;
  int block_n = 0, block_k = 0;
  size_t ld = 0;
};

// One row-major source matrix [rows, cols] as the checkpoint holds it.
struct SourceMatrix {
  const void* data = nullptr;
  SourceType type = SourceType::kBF16;
  long rows = 0, cols = 0;
  BlockScales scales;  // kFP8 only
};

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
  float* scale = nullptr;      // int8: w = scale * q; fp8: w = scale * e4m3
  float* scale_qsum = nullptr; // int8: scale * sum_k q over the group (activation zero-point term)

  int k_block() const { return format == WeightFormat::kBF16 ? 32 : 64; }
  bool fp8() const { return format == WeightFormat::kFP8; }
  size_t block_bytes() const { return format == WeightFormat::kINT4 ? 512 : 1024; }
  int num_k_blocks() const { return k / k_block(); }
  int num_groups() const { return format == WeightFormat::kBF16 ? 0 : k / group_size; }
  bool int4() const { return format == WeightFormat::kINT4; }
  // Int4 runs (see the top of the file).
  int run_k() const { return group_size > 64 ? group_size : 64; }
  size_t run_bytes() const {
    return size_t(run_k() / 64) * 512 + round_up(size_t(96) * (run_k() / group_size), 64);
  }
  size_t n_block_bytes() const {
    return int4() ? size_t(k / run_k()) * run_bytes() : size_t(num_k_blocks()) * block_bytes();
  }
  // First byte of n-block `nb`, and of its 64-k (32-k for bf16) block `kb` (int4: Int4Addr).
  uint8_t* n_block(int nb) const { return blocks + size_t(nb) * n_block_bytes(); }
  uint8_t* k_block(int nb, int kb) const;
  // Int4 metadata of group g of n-block nb: scale[16], scale_qsum[16], bias[16] (bf16).
  uint16_t* meta(int nb, int g) const;
  size_t blocks_bytes() const { return size_t(n / kBlockN) * n_block_bytes(); }
  // Floats of each scale array (int8: scale and scale_qsum; fp8: scale); the whole packed size.
  size_t group_floats() const {
    return format == WeightFormat::kINT8 || fp8() ? size_t(n) * num_groups() : 0;
  }
  int scale_arrays() const { return format == WeightFormat::kINT8 ? 2 : fp8() ? 1 : 0; }
  size_t total_bytes() const {
    return blocks_bytes() + scale_arrays() * group_floats() * sizeof(float);
  }
};

// An int4 matrix's k-blocks and group metadata within an n-block, by shifts and masks (run and
// group sizes are powers of two): PackedMatrix::k_block and meta use it, and loops that address a
// block or a group per packed row keep one (made once, no divisions).
struct Int4Addr {
  explicit Int4Addr(const PackedMatrix& m)
      : blocks(m.blocks), n_block_bytes(m.n_block_bytes()), run_bytes(m.run_bytes()),
        meta_at(size_t(m.run_k() / 64) * 512), run_shift(__builtin_ctz(m.run_k() / 64)),
        groups_shift(__builtin_ctz(m.run_k() / m.group_size)) {}
  const uint8_t* n_block(int nb) const { return blocks + size_t(nb) * n_block_bytes; }
  // k-block kb (64 k) and group g of the n-block at `nblock` (n_block's pointer).
  const uint8_t* k_block(const uint8_t* nblock, int kb) const {
    return nblock + size_t(kb >> run_shift) * run_bytes +
           size_t(kb & ((1 << run_shift) - 1)) * 512;
  }
  const uint16_t* meta(const uint8_t* nblock, int g) const {
    return reinterpret_cast<const uint16_t*>(nblock + size_t(g >> groups_shift) * run_bytes +
                                             meta_at + size_t(g & ((1 << groups_shift) - 1)) * 96);
  }
  const uint8_t* blocks;
  size_t n_block_bytes, run_bytes, meta_at;
  int run_shift, groups_shift;  // log2 of k-blocks and of groups per run
};

// PackedMatrix hands out writable pointers into its blocks (the packer fills them).
inline uint8_t* PackedMatrix::k_block(int nb, int kb) const {
  if (!int4()) return n_block(nb) + size_t(kb) * block_bytes();
  return const_cast<uint8_t*>(Int4Addr(*this).k_block(n_block(nb), kb));
}
inline uint16_t* PackedMatrix::meta(int nb, int g) const {
  return const_cast<uint16_t*>(Int4Addr(*this).meta(n_block(nb), g));
}

// Bytes of `m`'s arrays (fields n, k, group_size, format set): blocks, then the scale arrays
// (int8 two, fp8 one), each 64-byte aligned; place_packed points `m`'s arrays into that much
// memory at `memory` (64-byte aligned; the owner allocates and frees it, e.g. one mapping for
// many).
size_t packed_memory_bytes(const PackedMatrix& m);
void place_packed(PackedMatrix& m, uint8_t* memory);

// Packs 16 * num_blocks rows of a row-major source (`src` points at the first row's first column,
// leading dimension `ld` elements) into n-blocks starting at `nb_begin`. Rows past `valid_rows` and
// columns past `valid_cols` are zero. Quantizes int formats group-wise (int8 symmetric absmax;
// int4 asymmetric with a least-squares refit, which keeps the layer error under 0.15).
void pack_rows(PackedMatrix& m, int nb_begin, int num_blocks, const void* src, SourceType type,
               size_t ld, long valid_rows, long valid_cols);

// Packs n-blocks [nb_begin, nb_begin + num_blocks) of `m` from rows row0.. and columns col0.. of
// `src` (zero past its rows and columns): bf16/fp32 through pack_rows; FP8 codes copied as they
// are (layout/fp8_pack.cpp) with each row's block scale per group. FP8 needs the fp8 format, a
// group that divides block_k and col0 a multiple of the group (std::invalid_argument otherwise).
void pack_source(PackedMatrix& m, int nb_begin, int num_blocks, const SourceMatrix& src,
                 long row0, long col0);

}  // namespace hetmoe
