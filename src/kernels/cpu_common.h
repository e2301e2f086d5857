// Target-independent pieces of the CPU backend (cpu_attention.cc, cpu_decode.cc): key-range
// masking, per-thread scratch and block sizes. Compiled once, not per SIMD target.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/attention.h"

namespace pion::kernels::cpu {

// The MLA kernel (cpu_mla.cc), dispatched to the best target the CPU runs.
void AttendLatentDispatch(const LatentQueries& q, const LatentKeys& keys, float scale,
                          int64_t window, const Partial& out);

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Key rows [lo, hi) (clamped to [begin, end)) that a query at query_pos may see.
struct KeyRange {
  int64_t lo;
  int64_t hi;
};

inline KeyRange VisibleRange(int64_t query_pos, int64_t key_pos0, int64_t window, uint32_t begin,
                             uint32_t end) {
  const int64_t rel = query_pos - key_pos0;  // the last visible key row
  int64_t lo = begin;
  int64_t hi = std::min<int64_t>(end, rel + 1);
  if (window > 0) lo = std::max<int64_t>(lo, rel - window + 1);
  if (hi < lo) hi = lo;
  return {lo, hi};
}

inline bool Visible(int64_t query_pos, int64_t key_pos, int64_t window) {
  return key_pos <= query_pos && (window <= 0 || key_pos > query_pos - window);
}

inline float* Grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Per-thread scratch, reused across calls so that steady-state calls do not allocate.
struct Scratch {
  std::vector<float> k, v, s, qt, ot, aux;
  std::vector<uint32_t> rows, idx;
};

inline Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Key rows per block of the decode layout: the block's K and V stay within L1/L2.
constexpr size_t kMaxDecodeBlockRows = 128;
inline size_t DecodeBlockRows(uint32_t d) {
  return std::clamp<size_t>(8192 / std::max<uint32_t>(d, 1), 16, kMaxDecodeBlockRows);
}
// Query rows of one K/V head that the decode layout takes (more go to the tile layout).
constexpr size_t kMaxDecodeRows = 16;
constexpr size_t kTileBlockRows = 64;

}  // namespace pion::kernels::cpu
