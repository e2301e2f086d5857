// Which prefix keys a query row sees (seed 004 §0x04W): keys at positions <= the query's own
// and, with a window W > 0, > its own − W. Shared by the CPU and GPU executors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

namespace pion::attention {

// Keys visible to any query row at positions [p_lo, p_hi] under the window, intersected with
// rows [0, n) of a key set at positions pos0.. : returned as a row range [begin, end).
inline std::pair<uint32_t, uint32_t> VisibleRows(int64_t p_lo, int64_t p_hi, int64_t window,
                                                 int64_t pos0, uint32_t n) {
  int64_t lo = window > 0 ? p_lo - window + 1 : std::numeric_limits<int64_t>::min() / 2;
  int64_t begin = std::max<int64_t>(0, lo - pos0);
  int64_t end = std::min<int64_t>(n, p_hi - pos0 + 1);
  if (end <= begin) return {0, 0};
  return {static_cast<uint32_t>(begin), static_cast<uint32_t>(end)};
}

// Keys visible to one query at position p.
inline std::pair<uint32_t, uint32_t> VisibleFor(int64_t p, int64_t window, int64_t pos0,
                                                uint32_t n) {
  return VisibleRows(p, p, window, pos0, n);
}

// How many of the prefix rows [0, n) a query at position p sees.
inline uint64_t VisibleCount(int64_t p, int64_t window, uint32_t n) {
  auto [b, e] = VisibleFor(p, window, 0, n);
  return e - b;
}

}  // namespace pion::attention
