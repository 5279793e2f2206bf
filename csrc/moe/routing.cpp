// Counting sort of (token, slot) pairs by expert, rows padded to AMX tile height.
#include "moe/routing.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "layout/packed_matrix.h"

namespace hetmoe {

Routing route(const int64_t* ids, const float* weights, int q, int k, int num_experts,
              const std::vector<uint8_t>& gpu_mask, const std::vector<uint8_t>& loaded,
              int first_slot, int end_slot) {
  if (end_slot < 0) end_slot = k;
  auto routed = [&](long i) { return i % k >= first_slot && i % k < end_slot; };
  std::vector<int> count(num_experts, 0);
  int64_t unloaded = -1;  // the first expert routed to but never loaded
  for (long i = 0; i < long(q) * k; ++i) {
    if (!routed(i)) continue;
    const int64_t e = ids[i];
    if (e < -1 || e >= num_experts)  // the first bad id in row-major order
      throw std::out_of_range("expert_ids[" + std::to_string(i / k) + ", " +
                              std::to_string(i % k) + "] = " + std::to_string(e) +
                              (e < 0 ? " is below -1 (the id of a skipped slot)"
                                     : " is out of range [0, " + std::to_string(num_experts) +
                                           ")"));
    if (e < 0) continue;
    if (!gpu_mask.empty() && gpu_mask[e]) continue;
    if (!loaded[e] && unloaded < 0) unloaded = e;
    ++count[e];
  }
  // After the whole range pass: a bad id anywhere is reported before an unloaded expert.
  if (unloaded >= 0)
    throw std::runtime_error("expert " + std::to_string(unloaded) +
                             " is routed to but its weights were never loaded");
  Routing r;
  for (int e = 0; e < num_experts; ++e)
    if (count[e] > 0) r.experts.push_back(e);
  std::stable_sort(r.experts.begin(), r.experts.end(),
                   [&](int a, int b) { return count[a] > count[b]; });
  std::vector<long> cursor(num_experts, 0);
  for (int e : r.experts) {
    r.first_row.push_back(r.total_rows);
    r.rows.push_back(count[e]);
    r.max_rows = std::max(r.max_rows, count[e]);
    cursor[e] = r.total_rows;
    r.total_rows += long(round_up(count[e], 16));
  }
  r.row_token.assign(r.total_rows, -1);
  r.row_weight.assign(r.total_rows, 0.0f);
  r.slot_row.assign(size_t(q) * k, -1);
  for (long i = 0; i < long(q) * k; ++i) {
    const int64_t e = ids[i];
    if (!routed(i) || e < 0 || (!gpu_mask.empty() && gpu_mask[e])) continue;
    r.slot_row[i] = cursor[e];
    r.row_token[cursor[e]] = int(i / k);
    r.row_weight[cursor[e]++] = weights[i];
  }
  return r;
}

}  // namespace hetmoe
