// The CPU attention backend. Highway compiles this file once per x86 target (foreach_target) and
// HWY_DYNAMIC_DISPATCH picks the best one the CPU supports at run time.
//
// Attend runs an online softmax over blocks of key rows, per K/V head, with every query row that
// reads that head (its GQA group) processed together so each K/V row is fetched from memory once
// per call. Two layouts:
//   - few rows (decode, M=1): head dim in lanes. Scores are dot products, the block's probabilities
//     are computed lanes-over-keys, and o += p·v streams V. Memory-bound; K and V are read at
//     close to the single-thread read bandwidth.
//   - many rows (prefill, M >= lanes): query rows in lanes. Q is transposed once per row tile, so
//     a tile of scores is a rank-1 update per head-dim element and the softmax needs no
//     horizontal reductions; O is kept transposed and rescaled per lane.
// fp16 K/V are converted to fp32 one block at a time (F16C on AVX2/AVX-512, scalar before).
// All scratch is thread_local: concurrent calls on different threads share nothing.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu_attention.cc"
#include <hwy/foreach_target.h>  // must precede highway.h; re-includes this file per target
#include <hwy/highway.h>
//
#include <hwy/cache_control.h>
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/attention.h"
#include "kernels/fp16.h"

#ifndef PION_KERNELS_CPU_ATTENTION_SHARED
#define PION_KERNELS_CPU_ATTENTION_SHARED
namespace pion::kernels::cpu {

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

// Key rows per block of the decode layout: the converted K and V blocks stay within L1/L2.
inline size_t DecodeBlockRows(uint32_t d) {
  return std::clamp<size_t>(8192 / std::max<uint32_t>(d, 1), 16, 128);
}
constexpr size_t kTileBlockRows = 64;

}  // namespace pion::kernels::cpu
#endif  // PION_KERNELS_CPU_ATTENTION_SHARED

HWY_BEFORE_NAMESPACE();
namespace pion::kernels::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// ---- fp16 and row access --------------------------------------------------------------------

void HalfToFloat(const uint8_t* HWY_RESTRICT src, size_t n, float* HWY_RESTRICT dst) {
  size_t i = 0;
#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
  const DF df;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const size_t lanes = hn::Lanes(df);
  const auto* src16 = reinterpret_cast<const hwy::float16_t*>(src);
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, src16 + i)), df, dst + i);
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, src16 + i + lanes)), df, dst + i + lanes);
  }
  for (; i + lanes <= n; i += lanes) {
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, src16 + i)), df, dst + i);
  }
#endif
  for (; i < n; ++i) dst[i] = internal::LoadF16(src + 2 * i);
}

// Rows [row, row + count) of one head as fp32: in place for fp32, converted into buf for fp16.
const float* RowsF32(const Tensor3& t, uint32_t head, size_t row, size_t count, float* buf) {
  const uint8_t* p = t.Row(head, static_cast<uint32_t>(row));
  if (t.dtype == DType::kF32) return reinterpret_cast<const float*>(p);
  HalfToFloat(p, count * t.d, buf);
  return buf;
}

// One row, gathered into dst as fp32.
void CopyRowF32(const Tensor3& t, uint32_t head, uint32_t row, float* dst) {
  const uint8_t* p = t.Row(head, row);
  if (t.dtype == DType::kF32) {
    std::memcpy(dst, p, t.d * sizeof(float));
  } else {
    HalfToFloat(p, t.d, dst);
  }
}

// ---- small vector helpers -------------------------------------------------------------------

#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
constexpr bool kHaveF16C = true;  // vcvtph2ps: fp16 K/V are converted in registers
#else
constexpr bool kHaveF16C = false;  // fp16 K/V are converted into fp32 blocks first
#endif

// Loads one vector of elements of type T (float, or fp16 where kHaveF16C) as fp32.
template <class T>
HWY_INLINE VF LoadF32(const T* HWY_RESTRICT p) {
  const DF df;
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(df, p);
  } else {
#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
    return hn::PromoteTo(df, hn::LoadU(hn::Rebind<hwy::float16_t, DF>(), p));
#else
    static_assert(std::is_same_v<T, float>, "fp16 loads need F16C");
    return hn::Zero(df);
#endif
  }
}

template <class T>
HWY_INLINE float Dot(const float* HWY_RESTRICT a, const T* HWY_RESTRICT b, size_t n) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF s0 = hn::Zero(df), s1 = hn::Zero(df), s2 = hn::Zero(df), s3 = hn::Zero(df);
  size_t j = 0;
  for (; j + 4 * lanes <= n; j += 4 * lanes) {
    s0 = hn::MulAdd(hn::LoadU(df, a + j), LoadF32(b + j), s0);
    s1 = hn::MulAdd(hn::LoadU(df, a + j + lanes), LoadF32(b + j + lanes), s1);
    s2 = hn::MulAdd(hn::LoadU(df, a + j + 2 * lanes), LoadF32(b + j + 2 * lanes), s2);
    s3 = hn::MulAdd(hn::LoadU(df, a + j + 3 * lanes), LoadF32(b + j + 3 * lanes), s3);
  }
  for (; j + lanes <= n; j += lanes) s0 = hn::MulAdd(hn::LoadU(df, a + j), LoadF32(b + j), s0);
  float tail = 0.0f;
  if constexpr (std::is_same_v<T, float>) {
    for (; j < n; ++j) tail += a[j] * b[j];
  }
  return hn::GetLane(hn::SumOfLanes(df, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3)))) + tail;
}

#if HWY_TARGET != HWY_SCALAR
// Sums the lanes of one 128-bit block's worth: adds halves down to 128 bits.
template <class D>
HWY_INLINE hn::Vec<hn::Full128<float>> FoldToBlock(D d, hn::Vec<D> v) {
  if constexpr (hn::MaxLanes(D()) > 4) {
    const hn::Half<D> dh;
    return FoldToBlock(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  } else {
    return v;
  }
}
#endif

// out[i] = scale · Σ lanes of acc[i], i < 4: a partial transpose shares the reduction work
// (about 4 shuffles per key instead of ~10 for four separate horizontal sums).
HWY_INLINE void Sum4(const VF* acc, float scale, float* HWY_RESTRICT out) {
  const DF df;
#if HWY_TARGET == HWY_SCALAR
  (void)df;
  for (size_t i = 0; i < 4; ++i) out[i] = scale * hn::GetLane(acc[i]);
#else
  const hn::Repartition<double, DF> dd;
  const VF ab = hn::Add(hn::InterleaveLower(df, acc[0], acc[1]),
                        hn::InterleaveUpper(df, acc[0], acc[1]));  // a02 b02 a13 b13 per block
  const VF cd =
      hn::Add(hn::InterleaveLower(df, acc[2], acc[3]), hn::InterleaveUpper(df, acc[2], acc[3]));
  const auto ab64 = hn::BitCast(dd, ab), cd64 = hn::BitCast(dd, cd);
  const VF abcd = hn::Add(hn::BitCast(df, hn::InterleaveLower(dd, ab64, cd64)),
                          hn::BitCast(df, hn::InterleaveUpper(dd, ab64, cd64)));
  const hn::Full128<float> d4;
  hn::StoreU(hn::Mul(FoldToBlock(df, abcd), hn::Set(d4, scale)), d4, out);
#endif
}

// out[0, 4) = scale · q · k[i], for four rows of k, `stride` elements apart.
template <class T>
HWY_INLINE void Dot4(const float* HWY_RESTRICT q, const T* HWY_RESTRICT k, size_t stride, size_t n,
                     float scale, float* HWY_RESTRICT out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF acc[4], acc2[4];
  for (size_t i = 0; i < 4; ++i) acc[i] = acc2[i] = hn::Zero(df);
  size_t j = 0;
  for (; j + 2 * lanes <= n; j += 2 * lanes) {
    const VF q0 = hn::LoadU(df, q + j), q1 = hn::LoadU(df, q + j + lanes);
    for (size_t i = 0; i < 4; ++i) {
      acc[i] = hn::MulAdd(q0, LoadF32(k + i * stride + j), acc[i]);
      acc2[i] = hn::MulAdd(q1, LoadF32(k + i * stride + j + lanes), acc2[i]);
    }
  }
  for (; j + lanes <= n; j += lanes) {
    const VF q0 = hn::LoadU(df, q + j);
    for (size_t i = 0; i < 4; ++i) acc[i] = hn::MulAdd(q0, LoadF32(k + i * stride + j), acc[i]);
  }
  for (size_t i = 0; i < 4; ++i) acc[i] = hn::Add(acc[i], acc2[i]);
  Sum4(acc, scale, out);
}

// Max over x[0, n) (n a multiple of the lane count).
HWY_INLINE float MaxOf(const float* HWY_RESTRICT x, size_t n) {
  const DF df;
  VF mx = hn::Set(df, kNegInf);
  for (size_t t = 0; t < n; t += hn::Lanes(df)) mx = hn::Max(mx, hn::LoadU(df, x + t));
  return hn::GetLane(hn::MaxOfLanes(df, mx));
}

// x = exp(x - m) in place over [0, n) (n a multiple of the lane count); returns the sum.
HWY_INLINE float ExpInPlace(float* HWY_RESTRICT x, size_t n, float m) {
  const DF df;
  const VF vm = hn::Set(df, m);
  VF sum = hn::Zero(df);
  for (size_t t = 0; t < n; t += hn::Lanes(df)) {
    const VF p = hn::Exp(df, hn::Sub(hn::LoadU(df, x + t), vm));
    hn::StoreU(p, df, x + t);
    sum = hn::Add(sum, p);
  }
  return hn::GetLane(hn::SumOfLanes(df, sum));
}

// o[0, C lanes) = o * alpha + Σ_{t in [a, b)} p[t] · v[t][0, C lanes), v rows `stride` apart.
template <size_t C, class T>
HWY_INLINE void AccumulateChunk(float* HWY_RESTRICT o, float alpha, const float* HWY_RESTRICT p,
                                const T* HWY_RESTRICT v, size_t stride, size_t a, size_t b) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF acc[C];
  const VF va = hn::Set(df, alpha);
  for (size_t c = 0; c < C; ++c) acc[c] = hn::Mul(hn::LoadU(df, o + c * lanes), va);
  for (size_t t = a; t < b; ++t) {
    const VF pt = hn::Set(df, p[t]);
    const T* vt = v + t * stride;
    for (size_t c = 0; c < C; ++c) acc[c] = hn::MulAdd(pt, LoadF32(vt + c * lanes), acc[c]);
  }
  for (size_t c = 0; c < C; ++c) hn::StoreU(acc[c], df, o + c * lanes);
}

// o[0, d) = o * alpha + Σ_{t in [a, b)} p[t] · v[t] (d a multiple of the lane count).
template <class T>
HWY_INLINE void AccumulateRow(float* HWY_RESTRICT o, size_t d, float alpha,
                              const float* HWY_RESTRICT p, const T* HWY_RESTRICT v, size_t a,
                              size_t b) {
  const size_t lanes = hn::Lanes(DF());
  size_t j = 0;
  for (; j + 8 * lanes <= d; j += 8 * lanes) AccumulateChunk<8, T>(o + j, alpha, p, v + j, d, a, b);
  for (; j + 4 * lanes <= d; j += 4 * lanes) AccumulateChunk<4, T>(o + j, alpha, p, v + j, d, a, b);
  for (; j + 2 * lanes <= d; j += 2 * lanes) AccumulateChunk<2, T>(o + j, alpha, p, v + j, d, a, b);
  for (; j + lanes <= d; j += lanes) AccumulateChunk<1, T>(o + j, alpha, p, v + j, d, a, b);
}

// ---- decode layout: few query rows, head dim in lanes -----------------------------------------

// The rows of one group in the decode layout: query vector, output state, and visible keys.
struct DecodeRow {
  const float* q;
  float* m;
  float* l;
  float* o;
  int64_t lo, hi;  // visible key rows (absolute, within the block loop's range)
};

// The next block's K and V rows, prefetched while the current one is computed: a decode step does
// little arithmetic per byte, so DRAM must stay busy during the compute phases as well.
struct Prefetcher {
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  size_t row_bytes_k = 0, row_bytes_v = 0;
  size_t rows = 0;

  HWY_INLINE void Row(size_t t) const {
    if (t >= rows) return;
    for (size_t b = 0; b < row_bytes_k; b += 64) hwy::Prefetch(k + t * row_bytes_k + b);
    for (size_t b = 0; b < row_bytes_v; b += 64) hwy::Prefetch(v + t * row_bytes_v + b);
  }
};

// Folds key rows [0, nb) of a block (K, V rows d elements apart; absolute index t0 + t) into the
// states of rows[0, n). s is scratch for n * round_up(nb, lanes) scores.
template <class KT, class VT>
void DecodeBlock(const KT* HWY_RESTRICT k, const VT* HWY_RESTRICT v, size_t nb, int64_t t0,
                 size_t d, float scale, DecodeRow* rows, size_t n, float* HWY_RESTRICT s,
                 const Prefetcher& prefetch) {
  const size_t lanes = hn::Lanes(DF());
  const size_t nbp = (nb + lanes - 1) / lanes * lanes;
  size_t first = nb, last = 0;
  for (size_t r = 0; r < n; ++r) {
    const size_t a = static_cast<size_t>(std::clamp<int64_t>(rows[r].lo - t0, 0, nb));
    const size_t b = static_cast<size_t>(std::clamp<int64_t>(rows[r].hi - t0, 0, nb));
    float* sr = s + r * nbp;
    std::fill(sr, sr + a, kNegInf);
    std::fill(sr + std::max(a, b), sr + nbp, kNegInf);
    if (a < b) first = std::min(first, a), last = std::max(last, b);
  }
  if (first >= last) return;
  // Scores, key-major so a K row is reused from L1 by every query row of the group.
  // Prefetches of the next block are spread over this one's keys, a few lines per key.
  const size_t pf_step = (prefetch.rows + nb - 1) / std::max<size_t>(nb, 1);
  size_t pf_next = 0;
  for (size_t t = 0; t < first; ++t) {
    for (size_t i = 0; i < pf_step; ++i) prefetch.Row(pf_next++);
  }
  for (size_t t = first; t < last; t += 4) {
    const size_t group = std::min<size_t>(4, last - t);
    for (size_t i = 0; i < group * pf_step; ++i) prefetch.Row(pf_next++);
    const KT* kt = k + t * d;
    const int64_t pos = static_cast<int64_t>(t) + t0;
    for (size_t r = 0; r < n; ++r) {
      if (group == 4 && pos >= rows[r].lo && pos + 4 <= rows[r].hi) {
        Dot4(rows[r].q, kt, d, d, scale, s + r * nbp + t);
        continue;
      }
      for (size_t i = 0; i < group; ++i) {
        if (pos + static_cast<int64_t>(i) >= rows[r].lo &&
            pos + static_cast<int64_t>(i) < rows[r].hi) {
          s[r * nbp + t + i] = scale * Dot(rows[r].q, kt + i * d, d);
        }
      }
    }
  }
  for (size_t r = 0; r < n; ++r) {
    DecodeRow& row = rows[r];
    const size_t a = static_cast<size_t>(std::clamp<int64_t>(row.lo - t0, 0, nb));
    const size_t b = static_cast<size_t>(std::clamp<int64_t>(row.hi - t0, 0, nb));
    if (a >= b) continue;
    float* sr = s + r * nbp;
    const float m_new = std::max(*row.m, MaxOf(sr, nbp));
    if (m_new == kNegInf) continue;                // only -inf scores: nothing to add
    const float alpha = std::exp(*row.m - m_new);  // 0 when the state was empty
    const float sum = ExpInPlace(sr, nbp, m_new);
    *row.m = m_new;
    *row.l = *row.l * alpha + sum;
    AccumulateRow(row.o, d, alpha, sr, v, a, b);
  }
}

#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
// DecodeBlock straight from the stored rows (fp32 or fp16) of one K/V head.
void DecodeBlockInPlace(const Keys& keys, uint32_t g, int64_t t0, size_t nb, float scale,
                        DecodeRow* rows, size_t n, float* s, const Prefetcher& prefetch) {
  using F16 = hwy::float16_t;
  const size_t d = keys.k.d;
  const uint8_t* k = keys.k.Row(g, static_cast<uint32_t>(t0));
  const uint8_t* v = keys.v.Row(g, static_cast<uint32_t>(t0));
  const auto* kf = reinterpret_cast<const float*>(k);
  const auto* vf = reinterpret_cast<const float*>(v);
  const auto* kh = reinterpret_cast<const F16*>(k);
  const auto* vh = reinterpret_cast<const F16*>(v);
  const bool k16 = keys.k.dtype == DType::kF16, v16 = keys.v.dtype == DType::kF16;
  if (k16 && v16) {
    DecodeBlock(kh, vh, nb, t0, d, scale, rows, n, s, prefetch);
  } else if (k16) {
    DecodeBlock(kh, vf, nb, t0, d, scale, rows, n, s, prefetch);
  } else if (v16) {
    DecodeBlock(kf, vh, nb, t0, d, scale, rows, n, s, prefetch);
  } else {
    DecodeBlock(kf, vf, nb, t0, d, scale, rows, n, s, prefetch);
  }
}
#else
void DecodeBlockInPlace(const Keys&, uint32_t, int64_t, size_t, float, DecodeRow*, size_t, float*,
                        const Prefetcher&) {}
#endif

void AttendDecodeGroup(const Queries& q, const Keys& keys, float scale, int64_t window, uint32_t g,
                       const uint32_t* heads, size_t nheads, const Partial& out, Scratch& scratch) {
  const uint32_t d = q.d;
  constexpr size_t kMaxRows = 64;
  DecodeRow rows[kMaxRows];
  const size_t n = nheads * q.m;
  int64_t lo = keys.end, hi = keys.begin;
  for (size_t h = 0, r = 0; h < nheads; ++h) {
    for (uint32_t i = 0; i < q.m; ++i, ++r) {
      const size_t row = static_cast<size_t>(heads[h]) * q.m + i;
      const KeyRange range = VisibleRange(q.pos0 + i, keys.pos0, window, keys.begin, keys.end);
      rows[r] = {q.q + row * d, out.m + row, out.l + row, out.o + row * d, range.lo, range.hi};
      if (range.lo < range.hi) lo = std::min(lo, range.lo), hi = std::max(hi, range.hi);
    }
  }
  const size_t block = DecodeBlockRows(d);
  const size_t lanes = hn::Lanes(DF());
  float* s = Grow(scratch.s, n * ((block + lanes - 1) / lanes * lanes));
  float* kbuf = !kHaveF16C && keys.k.dtype == DType::kF16 ? Grow(scratch.k, block * d) : nullptr;
  float* vbuf = !kHaveF16C && keys.v.dtype == DType::kF16 ? Grow(scratch.v, block * d) : nullptr;
  for (int64_t t0 = lo; t0 < hi; t0 += block) {
    const size_t nb = static_cast<size_t>(std::min<int64_t>(block, hi - t0));
    Prefetcher prefetch;
    if (t0 + static_cast<int64_t>(block) < hi) {
      prefetch.k = keys.k.Row(g, static_cast<uint32_t>(t0 + block));
      prefetch.v = keys.v.Row(g, static_cast<uint32_t>(t0 + block));
      prefetch.row_bytes_k = d * DTypeSize(keys.k.dtype);
      prefetch.row_bytes_v = d * DTypeSize(keys.v.dtype);
      prefetch.rows = static_cast<size_t>(std::min<int64_t>(block, hi - t0 - block));
    }
    // With F16C, fp16 rows are converted in registers where they are used (measured faster than
    // converting each block into fp32 scratch once, even for a group of 4 query rows).
    if constexpr (kHaveF16C) {
      DecodeBlockInPlace(keys, g, t0, nb, scale, rows, n, s, prefetch);
      continue;
    }
    DecodeBlock(RowsF32(keys.k, g, t0, nb, kbuf), RowsF32(keys.v, g, t0, nb, vbuf), nb, t0, d,
                scale, rows, n, s, prefetch);
  }
}

// Sparse lists: each query row gathers its visible key rows into fp32 blocks.
void AttendSparseRow(const Queries& q, const Keys& keys, float scale, int64_t window, size_t row,
                     const Partial& out, Scratch& scratch) {
  const uint32_t d = q.d;
  const uint32_t h = static_cast<uint32_t>(row / q.m);
  const uint32_t g = static_cast<uint32_t>(q.head_map[h]);
  const int64_t qpos = q.pos0 + static_cast<int64_t>(row % q.m);
  const int32_t* list = keys.rows + row * keys.stride;
  const int32_t count = keys.counts[row];
  const size_t block = DecodeBlockRows(d);
  const size_t lanes = hn::Lanes(DF());
  float* s = Grow(scratch.s, (block + lanes - 1) / lanes * lanes);
  float* kbuf = Grow(scratch.k, block * d);
  float* vbuf = Grow(scratch.v, block * d);
  DecodeRow state{q.q + row * d, out.m + row, out.l + row, out.o + row * d, 0, 0};
  size_t nb = 0;
  for (int32_t c = 0; c <= count; ++c) {
    if (c < count) {
      const uint32_t t = static_cast<uint32_t>(list[c]);
      if (!Visible(qpos, keys.pos0 + t, window)) continue;
      CopyRowF32(keys.k, g, t, kbuf + nb * d);
      CopyRowF32(keys.v, g, t, vbuf + nb * d);
      ++nb;
    }
    if (nb == block || (c == count && nb > 0)) {
      state.lo = 0;
      state.hi = static_cast<int64_t>(nb);
      DecodeBlock(kbuf, vbuf, nb, 0, d, scale, &state, 1, s, Prefetcher());
      nb = 0;
    }
  }
}

// ---- tile layout: many query rows in lanes ----------------------------------------------------

#if HWY_TARGET <= HWY_AVX3
constexpr size_t kTileVecs = 4;  // 32 vector registers: 16 accumulators + operands
#else
constexpr size_t kTileVecs = 2;  // 16 vector registers
#endif
constexpr size_t kTileKeys = 4;

// S[t][c] = Σ_j k[t][j] · qt[j][c] for keys t in [0, nb), lanes c of NV vectors; rows `rt` apart.
template <size_t NV>
void TileScores(const float* HWY_RESTRICT k, size_t nb, size_t d, const float* HWY_RESTRICT qt,
                size_t rt, float* HWY_RESTRICT s) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  size_t t = 0;
  for (; t + kTileKeys <= nb; t += kTileKeys) {
    VF acc[kTileKeys][NV];
    for (size_t kk = 0; kk < kTileKeys; ++kk) {
      for (size_t c = 0; c < NV; ++c) acc[kk][c] = hn::Zero(df);
    }
    const float* kt = k + t * d;
    for (size_t j = 0; j < d; ++j) {
      VF qv[NV];
      for (size_t c = 0; c < NV; ++c) qv[c] = hn::LoadU(df, qt + j * rt + c * lanes);
      for (size_t kk = 0; kk < kTileKeys; ++kk) {
        const VF kb = hn::Set(df, kt[kk * d + j]);
        for (size_t c = 0; c < NV; ++c) acc[kk][c] = hn::MulAdd(kb, qv[c], acc[kk][c]);
      }
    }
    for (size_t kk = 0; kk < kTileKeys; ++kk) {
      for (size_t c = 0; c < NV; ++c) hn::StoreU(acc[kk][c], df, s + (t + kk) * rt + c * lanes);
    }
  }
  for (; t < nb; ++t) {
    VF acc[NV];
    for (size_t c = 0; c < NV; ++c) acc[c] = hn::Zero(df);
    const float* kt = k + t * d;
    for (size_t j = 0; j < d; ++j) {
      const VF kb = hn::Set(df, kt[j]);
      for (size_t c = 0; c < NV; ++c) {
        acc[c] = hn::MulAdd(kb, hn::LoadU(df, qt + j * rt + c * lanes), acc[c]);
      }
    }
    for (size_t c = 0; c < NV; ++c) hn::StoreU(acc[c], df, s + t * rt + c * lanes);
  }
}

// ot[j][c] = ot[j][c] · alpha[c] + Σ_t v[t][j] · p[t][c] for lanes c of NV vectors.
template <size_t NV>
void TileAccumulate(const float* HWY_RESTRICT v, size_t nb, size_t d, const float* HWY_RESTRICT p,
                    const float* HWY_RESTRICT alpha, size_t rt, float* HWY_RESTRICT ot) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  constexpr size_t kJ = 4;
  VF va[NV];
  for (size_t c = 0; c < NV; ++c) va[c] = hn::LoadU(df, alpha + c * lanes);
  for (size_t j = 0; j < d; j += kJ) {
    VF acc[kJ][NV];
    for (size_t jj = 0; jj < kJ; ++jj) {
      for (size_t c = 0; c < NV; ++c) {
        acc[jj][c] = hn::Mul(hn::LoadU(df, ot + (j + jj) * rt + c * lanes), va[c]);
      }
    }
    for (size_t t = 0; t < nb; ++t) {
      VF pv[NV];
      for (size_t c = 0; c < NV; ++c) pv[c] = hn::LoadU(df, p + t * rt + c * lanes);
      const float* vt = v + t * d + j;
      for (size_t jj = 0; jj < kJ; ++jj) {
        const VF vb = hn::Set(df, vt[jj]);
        for (size_t c = 0; c < NV; ++c) acc[jj][c] = hn::MulAdd(vb, pv[c], acc[jj][c]);
      }
    }
    for (size_t jj = 0; jj < kJ; ++jj) {
      for (size_t c = 0; c < NV; ++c) hn::StoreU(acc[jj][c], df, ot + (j + jj) * rt + c * lanes);
    }
  }
}

template <size_t NV>
void TileScoresN(size_t nv, const float* k, size_t nb, size_t d, const float* qt, size_t rt,
                 float* s) {
  if constexpr (NV > 1) {
    if (nv < NV) return TileScoresN<NV - 1>(nv, k, nb, d, qt, rt, s);
  }
  TileScores<NV>(k, nb, d, qt, rt, s);
}

template <size_t NV>
void TileAccumulateN(size_t nv, const float* v, size_t nb, size_t d, const float* p,
                     const float* alpha, size_t rt, float* ot) {
  if constexpr (NV > 1) {
    if (nv < NV) return TileAccumulateN<NV - 1>(nv, v, nb, d, p, alpha, rt, ot);
  }
  TileAccumulate<NV>(v, nb, d, p, alpha, rt, ot);
}

// Query rows rows[0, n) (global row indices, n <= lanes * kTileVecs) of K/V head g.
void AttendTile(const Queries& q, const Keys& keys, float scale, int64_t window, uint32_t g,
                const uint32_t* rows, size_t n, const Partial& out, Scratch& scratch) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const size_t rt = lanes * kTileVecs;
  const size_t nv = (n + lanes - 1) / lanes;
  const uint32_t d = q.d;
  const size_t block = kTileBlockRows;
  float* qt = Grow(scratch.qt, static_cast<size_t>(d) * rt);
  float* ot = Grow(scratch.ot, static_cast<size_t>(d) * rt);
  float* s = Grow(scratch.s, block * rt);
  float* aux = Grow(scratch.aux, 5 * rt);
  float* lo_f = aux;  // visible key rows [lo, hi) per lane, as floats (exact below 2^24)
  float* hi_f = aux + rt;
  float* m = aux + 2 * rt;
  float* l = aux + 3 * rt;
  float* alpha = aux + 4 * rt;
  float* kbuf = keys.k.dtype == DType::kF16 ? Grow(scratch.k, block * d) : nullptr;
  float* vbuf = keys.v.dtype == DType::kF16 ? Grow(scratch.v, block * d) : nullptr;

  int64_t lo = keys.end, hi = keys.begin;          // union of the visible ranges
  int64_t all_lo = keys.begin, all_hi = keys.end;  // intersection
  for (size_t c = 0; c < rt; ++c) {
    if (c < n) {
      const size_t row = rows[c];
      const float* qr = q.q + row * d;
      for (uint32_t j = 0; j < d; ++j) qt[j * rt + c] = qr[j];
      const KeyRange range = VisibleRange(q.pos0 + static_cast<int64_t>(row % q.m), keys.pos0,
                                          window, keys.begin, keys.end);
      lo_f[c] = static_cast<float>(range.lo);
      hi_f[c] = static_cast<float>(range.hi);
      if (range.lo < range.hi) lo = std::min(lo, range.lo), hi = std::max(hi, range.hi);
      all_lo = std::max(all_lo, range.lo);
      all_hi = std::min(all_hi, range.hi);
    } else {  // padding lanes: zero queries, never masked, discarded
      for (uint32_t j = 0; j < d; ++j) qt[j * rt + c] = 0.0f;
      lo_f[c] = static_cast<float>(keys.begin);
      hi_f[c] = static_cast<float>(keys.end);
    }
    m[c] = kNegInf;
    l[c] = 0.0f;
  }
  std::fill(ot, ot + static_cast<size_t>(d) * rt, 0.0f);

  const VF vscale = hn::Set(df, scale);
  const VF neg_inf = hn::Set(df, kNegInf);
  for (int64_t t0 = lo; t0 < hi; t0 += block) {
    const size_t nb = static_cast<size_t>(std::min<int64_t>(block, hi - t0));
    const float* k = RowsF32(keys.k, g, t0, nb, kbuf);
    const float* v = RowsF32(keys.v, g, t0, nb, vbuf);
    TileScoresN<kTileVecs>(nv, k, nb, d, qt, rt, s);
    const bool masked = t0 < all_lo || t0 + static_cast<int64_t>(nb) > all_hi;
    for (size_t c = 0; c < nv; ++c) {
      const size_t off = c * lanes;
      const VF vlo = hn::LoadU(df, lo_f + off);
      const VF vhi = hn::LoadU(df, hi_f + off);
      VF mx = neg_inf;
      for (size_t t = 0; t < nb; ++t) {
        VF x = hn::Mul(hn::LoadU(df, s + t * rt + off), vscale);
        if (masked) {
          const VF pos = hn::Set(df, static_cast<float>(t0 + static_cast<int64_t>(t)));
          x = hn::IfThenElse(hn::And(hn::Ge(pos, vlo), hn::Lt(pos, vhi)), x, neg_inf);
        }
        hn::StoreU(x, df, s + t * rt + off);
        mx = hn::Max(mx, x);
      }
      const VF m_old = hn::LoadU(df, m + off);
      const VF m_new = hn::Max(m_old, mx);
      // Lanes with no visible key yet subtract 0 instead of -inf: p and alpha become 0, not NaN.
      const VF m_use = hn::IfThenElse(hn::Eq(m_new, neg_inf), hn::Zero(df), m_new);
      const VF a = hn::Exp(df, hn::Sub(m_old, m_use));
      VF sum = hn::Zero(df);
      for (size_t t = 0; t < nb; ++t) {
        const VF p = hn::Exp(df, hn::Sub(hn::LoadU(df, s + t * rt + off), m_use));
        hn::StoreU(p, df, s + t * rt + off);
        sum = hn::Add(sum, p);
      }
      hn::StoreU(m_new, df, m + off);
      hn::StoreU(hn::MulAdd(hn::LoadU(df, l + off), a, sum), df, l + off);
      hn::StoreU(a, df, alpha + off);
    }
    TileAccumulateN<kTileVecs>(nv, v, nb, d, s, alpha, rt, ot);
  }

  for (size_t c = 0; c < n; ++c) {
    const size_t row = rows[c];
    out.m[row] = m[c];
    out.l[row] = m[c] == kNegInf ? 0.0f : l[c];
    float* o = out.o + row * d;
    for (uint32_t j = 0; j < d; ++j) o[j] = m[c] == kNegInf ? 0.0f : ot[j * rt + c];
  }
}

// ---- entry points -----------------------------------------------------------------------------

void Attend(const Queries& q, const Keys& keys, float scale, int64_t window, const Partial& out) {
  Scratch& scratch = ThreadScratch();
  ClearPartial(out);
  if (keys.rows != nullptr) {
    for (size_t row = 0; row < static_cast<size_t>(q.hq) * q.m; ++row) {
      AttendSparseRow(q, keys, scale, window, row, out, scratch);
    }
    return;
  }
  if (keys.begin >= keys.end) return;
  const size_t lanes = hn::Lanes(DF());
  const size_t rt = lanes * kTileVecs;
  std::vector<uint32_t>& heads = scratch.idx;
  std::vector<uint32_t>& rows = scratch.rows;
  for (uint32_t g = 0; g < keys.k.heads; ++g) {
    heads.clear();
    for (uint32_t h = 0; h < q.hq; ++h) {
      if (static_cast<uint32_t>(q.head_map[h]) == g) heads.push_back(h);
    }
    if (heads.empty()) continue;
    const size_t n = heads.size() * q.m;
    if (n < lanes && n <= 64) {
      AttendDecodeGroup(q, keys, scale, window, g, heads.data(), heads.size(), out, scratch);
      continue;
    }
    rows.clear();
    for (uint32_t h : heads) {
      for (uint32_t i = 0; i < q.m; ++i) rows.push_back(h * q.m + i);
    }
    for (size_t r0 = 0; r0 < n; r0 += rt) {
      AttendTile(q, keys, scale, window, g, rows.data() + r0, std::min(rt, n - r0), out, scratch);
    }
  }
}

void Scores(const Queries& q, const Keys& keys, float scale, int64_t window, float* out) {
  Scratch& scratch = ThreadScratch();
  const uint32_t d = q.d;
  const size_t n = keys.end - keys.begin;
  if (n == 0) return;
  const size_t block = DecodeBlockRows(d);
  float* kbuf = keys.k.dtype == DType::kF16 ? Grow(scratch.k, block * d) : nullptr;
  for (uint32_t h = 0; h < q.hq; ++h) {
    const uint32_t g = static_cast<uint32_t>(q.head_map[h]);
    for (size_t t0 = keys.begin; t0 < keys.end; t0 += block) {
      const size_t nb = std::min<size_t>(block, keys.end - t0);
      const float* k = RowsF32(keys.k, g, t0, nb, kbuf);
      for (uint32_t i = 0; i < q.m; ++i) {
        const size_t row = static_cast<size_t>(h) * q.m + i;
        const float* qr = q.q + row * d;
        float* dst = out + row * n + (t0 - keys.begin);
        for (size_t t = 0; t < nb; ++t) {
          dst[t] = Visible(q.pos0 + i, keys.pos0 + static_cast<int64_t>(t0 + t), window)
                       ? scale * Dot(qr, k + t * d, d)
                       : kNegInf;
        }
      }
    }
  }
}

void Summarize(const Tensor3& k, const BlockSummaries& out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  Scratch& scratch = ThreadScratch();
  const uint32_t d = out.d;
  float* kbuf =
      k.dtype == DType::kF16 ? Grow(scratch.k, static_cast<size_t>(out.block) * d) : nullptr;
  for (uint32_t h = 0; h < out.heads; ++h) {
    for (uint32_t b = 0; b < out.nblocks; ++b) {
      const size_t first = static_cast<size_t>(b) * out.block;
      const size_t last = std::min<size_t>(first + out.block, k.rows);
      const size_t base = (static_cast<size_t>(h) * out.nblocks + b) * d;
      if (last <= first) {
        std::fill(out.mean + base, out.mean + base + d, 0.0f);
        std::fill(out.min + base, out.min + base + d, 0.0f);
        std::fill(out.max + base, out.max + base + d, 0.0f);
        continue;
      }
      const size_t count = last - first;
      const float* rows = RowsF32(k, h, first, count, kbuf);
      const VF inv = hn::Set(df, 1.0f / static_cast<float>(count));
      size_t j = 0;
      for (; j + lanes <= d; j += lanes) {
        VF sum = hn::Zero(df);
        VF lo = hn::LoadU(df, rows + j);
        VF hi = lo;
        for (size_t t = 0; t < count; ++t) {
          const VF x = hn::LoadU(df, rows + t * d + j);
          sum = hn::Add(sum, x);
          lo = hn::Min(lo, x);
          hi = hn::Max(hi, x);
        }
        hn::StoreU(hn::Mul(sum, inv), df, out.mean + base + j);
        hn::StoreU(lo, df, out.min + base + j);
        hn::StoreU(hi, df, out.max + base + j);
      }
      for (; j < d; ++j) {
        float sum = 0.0f, lo = rows[j], hi = rows[j];
        for (size_t t = 0; t < count; ++t) {
          const float x = rows[t * d + j];
          sum += x;
          lo = std::min(lo, x);
          hi = std::max(hi, x);
        }
        out.mean[base + j] = sum / static_cast<float>(count);
        out.min[base + j] = lo;
        out.max[base + j] = hi;
      }
    }
  }
}

void ScoreBlocks(const Queries& q, const BlockSummaries& s, BlockSelector selector, float* out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const uint32_t d = s.d;
  for (uint32_t h = 0; h < q.hq; ++h) {
    const uint32_t g = static_cast<uint32_t>(q.head_map[h]);
    const float* qr = q.q + static_cast<size_t>(h) * q.m * q.d;
    for (uint32_t b = 0; b < s.nblocks; ++b) {
      const size_t base = (static_cast<size_t>(g) * s.nblocks + b) * d;
      float score;
      if (selector == BlockSelector::kMean) {
        score = Dot(qr, s.mean + base, d);
      } else {
        VF acc = hn::Zero(df);
        size_t j = 0;
        for (; j + lanes <= d; j += lanes) {
          const VF x = hn::LoadU(df, qr + j);
          acc = hn::Add(acc, hn::Max(hn::Mul(x, hn::LoadU(df, s.min + base + j)),
                                     hn::Mul(x, hn::LoadU(df, s.max + base + j))));
        }
        score = hn::GetLane(hn::SumOfLanes(df, acc));
        for (; j < d; ++j) score += std::max(qr[j] * s.min[base + j], qr[j] * s.max[base + j]);
      }
      out[static_cast<size_t>(h) * s.nblocks + b] = score;
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace pion::kernels::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pion::kernels {
namespace cpu {

HWY_EXPORT(Attend);
HWY_EXPORT(Scores);
HWY_EXPORT(Summarize);
HWY_EXPORT(ScoreBlocks);

namespace {

class CpuBackend final : public AttentionKernels {
 public:
  std::string_view name() const override { return "cpu"; }
  void Attend(const Queries& q, const Keys& keys, float scale, int64_t window,
              const Partial& out) const override {
    HWY_DYNAMIC_DISPATCH(Attend)(q, keys, scale, window, out);
  }
  void Scores(const Queries& q, const Keys& keys, float scale, int64_t window,
              float* out) const override {
    HWY_DYNAMIC_DISPATCH(Scores)(q, keys, scale, window, out);
  }
  void Summarize(const Tensor3& k, const BlockSummaries& out) const override {
    HWY_DYNAMIC_DISPATCH(Summarize)(k, out);
  }
  void ScoreBlocks(const Queries& q, const BlockSummaries& s, BlockSelector selector,
                   float* out) const override {
    HWY_DYNAMIC_DISPATCH(ScoreBlocks)(q, s, selector, out);
  }
};

}  // namespace
}  // namespace cpu

const AttentionKernels& CpuKernels() {
  static const cpu::CpuBackend backend;
  return backend;
}

}  // namespace pion::kernels
#endif  // HWY_ONCE
