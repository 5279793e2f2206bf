// Groups the (token, slot) pairs of one MoE call by expert: the plan every phase reads.
#pragma once

#include <cstdint>
#include <vector>

namespace hetmoe {

struct Routing {
  std::vector<int> experts;    // active experts, most rows first (balances the task queue)
  std::vector<int> rows;       // rows per active expert
  std::vector<long> first_row; // first row of each active expert; experts start 16-aligned
  std::vector<int> row_token;  // token of each row, -1 for padding rows
  std::vector<float> row_weight;
  std::vector<long> slot_row;  // [q * k] row of each (token, slot) pair, -1 when skipped
  long total_rows = 0;         // including padding
  int max_rows = 0;
};

// ids/weights: [q, k]; only each token's slots [first_slot, end_slot) are routed (end_slot < 0:
// k), the others get slot_row -1. Ids < 0 and experts marked in `gpu_mask` (may be empty) are
// skipped. Throws std::out_of_range for a routed id outside [-1, num_experts) (before any other
// error), std::runtime_error for an expert never loaded.
Routing route(const int64_t* ids, const float* weights, int q, int k, int num_experts,
              const std::vector<uint8_t>& gpu_mask, const std::vector<uint8_t>& loaded,
              int first_slot = 0, int end_slot = -1);

}  // namespace hetmoe
