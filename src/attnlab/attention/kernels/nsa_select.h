// Native sparse attention's block selection, shared by the CPU kernels that make the compressed
// branch: nsa_cpu.cpp (a whole sequence, training and prefill) and decode_cpu.cpp (a few queries
// through a cache), so both choose the same blocks from the same probabilities.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace attnlab_cpu {

// Native sparse attention's block selection for one query at position pos (eq. 9-10 and the top-n
// rule of attention/nsa.py's block_importance and choose_blocks), from mass [1 + N]: the query's
// probabilities summed over its heads, of the memory slot, then compressed blocks 0 .. N-1 (block i
// covers stride units i .. i + l/d - 1). A selection block m (units m l'/d .. (m + 1) l'/d - 1)
// scores the sum over its units of the mass of the compressed blocks covering them. The query takes
// block 0, its own block, and the best-scoring other blocks that start at or before it (ties: the
// lower block), up to n_select: out [n_select], ascending, then -1 for slots left empty.
// config: compress block l, stride d, selection block l', n_select.
inline void choose_blocks(const float* mass, int64_t n_keys, int64_t pos, const int64_t* config,
                          std::vector<float>& importance, std::vector<int64_t>& order, int64_t* out, float* scores) {
  const int64_t per_compress = config[0] / config[1], sel = config[2], n_select = config[3];
  const int64_t per_select = sel / config[1], n_compressed = n_keys - 1;
  const float* blocks = mass + 1;
  const int64_t current = pos / sel;
  importance.assign(current + 1, 0.0f);
  for (int64_t m = 0; m <= current; ++m) {
    float total = 0.0f;
    for (int64_t u = m * per_select; u < (m + 1) * per_select; ++u) {
      float unit = 0.0f;
      for (int64_t shift = 0; shift < per_compress; ++shift) {
        const int64_t i = u - shift;
        if (i >= 0 && i < n_compressed) unit += blocks[i];
      }
      total += unit;
    }
    importance[m] = total;
  }
  order.clear();
  for (int64_t m = 1; m < current; ++m) order.push_back(m);
  const int64_t n_forced = current == 0 ? 1 : 2;
  const int64_t n_free = std::min<int64_t>(std::max<int64_t>(0, n_select - n_forced), int64_t(order.size()));
  std::partial_sort(order.begin(), order.begin() + n_free, order.end(), [&](int64_t a, int64_t b) {
    return importance[a] > importance[b] || (importance[a] == importance[b] && a < b);
  });
  int64_t taken = 0;
  out[taken++] = 0;
  for (int64_t f = 0; f < n_free; ++f) out[taken++] = order[f];
  std::sort(out + 1, out + taken);
  if (current > 0) out[taken++] = current;
  for (int64_t f = taken; f < n_select; ++f) out[f] = -1;
  if (scores)
    for (int64_t f = 0; f < n_select; ++f) scores[f] = out[f] >= 0 ? importance[out[f]] : 0.0f;
}

}  // namespace attnlab_cpu
