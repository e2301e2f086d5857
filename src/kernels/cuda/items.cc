// Host-side grouping of query rows into kernel work items (cuda_attention.h); plain C++, built
// with or without CUDA.
#include <algorithm>
#include <iterator>

#include "kernels/cuda/cuda_attention.h"

namespace pion::kernels::cuda {

std::vector<Item> DenseItems(uint32_t hq, uint32_t m, const int32_t* head_map, int pad) {
  std::vector<Item> items;
  int32_t kv_max = 0;
  for (uint32_t h = 0; h < hq; ++h) kv_max = std::max(kv_max, head_map[h]);
  for (int32_t kv = 0; kv <= kv_max; ++kv) {
    // Rows of this K/V head ordered by position first, so a group spans few positions.
    std::vector<int32_t> heads;
    for (uint32_t h = 0; h < hq; ++h) {
      if (head_map[h] == kv) heads.push_back(static_cast<int32_t>(h));
    }
    if (heads.empty()) continue;
    Item cur;
    cur.kv = kv;
    for (uint32_t i = 0; i < m; ++i) {
      for (int32_t h : heads) {
        cur.rows[cur.n++] = static_cast<int32_t>(h * m + i);
        if (cur.n == kItemRows) {
          items.push_back(cur);
          cur.n = 0;
        }
      }
    }
    if (cur.n > 0) items.push_back(cur);
    Item empty;
    empty.kv = kv;
    while (items.size() % pad != 0) items.push_back(empty);
  }
  return items;
}

std::vector<Item> RowItems(uint32_t hq, uint32_t m, const int32_t* head_map) {
  std::vector<Item> items(size_t{hq} * m);
  for (uint32_t r = 0; r < hq * m; ++r) {
    items[r].kv = head_map[r / m];
    items[r].n = 1;
    items[r].rows[0] = static_cast<int32_t>(r);
  }
  return items;
}

uint32_t MaxRows(const std::vector<Item>& items) {
  int32_t n = 0;
  for (const Item& it : items) n = std::max(n, it.n);
  return static_cast<uint32_t>(n);
}

uint32_t UniformGroup(const std::vector<Item>& items, uint32_t m) {
  if (m != 1 || items.empty()) return 0;
  const int32_t g = items[0].n;
  if (g <= 0) return 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    if (it.kv != static_cast<int32_t>(i) || it.n != g) return 0;
    for (int32_t j = 0; j < g; ++j) {
      if (it.rows[j] != static_cast<int32_t>(i) * g + j) return 0;
    }
  }
  return static_cast<uint32_t>(g);
}

uint32_t GroupMembers(uint32_t hq, const int32_t* head_map, uint32_t heads,
                      int16_t (&members)[kMaxFusedHeads * kMaxSharedGroup]) {
  if (heads > static_cast<uint32_t>(kMaxFusedHeads) || hq > 32767) return 0;
  std::fill(std::begin(members), std::end(members), int16_t{-1});
  std::vector<uint32_t> size(heads, 0);
  uint32_t most = 0;
  for (uint32_t h = 0; h < hq; ++h) {
    const auto kv = static_cast<uint32_t>(head_map[h]);
    if (size[kv] == kMaxSharedGroup) return 0;
    members[size_t{kv} * kMaxSharedGroup + size[kv]++] = static_cast<int16_t>(h);
    most = std::max(most, size[kv]);
  }
  return most;
}

}  // namespace pion::kernels::cuda
