// The decode layout of the CPU backend: few query rows per K/V head (M=1 decode with a GQA group
// of up to kMaxDecodeRows rows, and sparse row lists), head dim in lanes. Highway compiles this
// file once per x86 target; cpu_attention.cc (same targets) calls it from its Attend.
//
// Per block of key rows, every query row of the group is processed together so that each K and V
// vector is loaded (and, for fp16, converted) once per block, not once per query row:
//   1. scores: four keys at a time, R query rows × 4 keys of lane-wise partial dot products in
//      registers, reduced together by a partial transpose (no per-key horizontal sums);
//   2. softmax: block max, p = exp(s − m) vectorized over keys, (m, l) rescaled once per block;
//   3. o += p·V as a register-tiled micro-GEMM: R rows × T vectors of o held in registers over
//      the block's keys, each V vector loaded once and multiplied by R broadcast probabilities.
// The next block's K/V rows are prefetched during the score phase: a decode step does little
// arithmetic per byte, so DRAM must stay busy while the block is computed.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu_decode.cc"
#include <hwy/foreach_target.h>  // must precede highway.h; re-includes this file per target
#include <hwy/highway.h>
//
#include <hwy/cache_control.h>
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <cmath>

#include "kernels/attention.h"
#include "kernels/cpu_common.h"
#include "kernels/cpu_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pion::kernels::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET <= HWY_AVX3
constexpr size_t kAccVecs = 16;   // accumulators of a register tile (32 vector registers)
constexpr size_t kScoreRows = 4;  // query rows per score tile: 4 rows × 4 keys = 16 accumulators
#else
constexpr size_t kAccVecs = 8;  // 16 vector registers
constexpr size_t kScoreRows = 2;
#endif
constexpr size_t kUpdateRows = kAccVecs / 2;  // query rows per o += p·V tile (2+ vectors each)
// Row stride of the probability scratch: p[r][t] at a constant offset from p[0][t].
constexpr size_t kPStride = kMaxDecodeBlockRows;

// The rows of one group in the decode layout: query vectors, output states and visible keys.
struct DecodeRows {
  const float* q[kMaxDecodeRows];
  float* o[kMaxDecodeRows];
  float* m[kMaxDecodeRows];
  float* l[kMaxDecodeRows];
  int64_t lo[kMaxDecodeRows], hi[kMaxDecodeRows];  // visible key rows (absolute)
  size_t n = 0;
};

// The next block's K and V rows, prefetched while the current one is computed.
struct Prefetcher {
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  size_t row_bytes_k = 0, row_bytes_v = 0;
  size_t rows = 0;
  size_t next = 0;
  size_t per_step = 4;  // rows per four keys scored

  HWY_INLINE void Rows(size_t count) {
    for (const size_t stop = std::min(rows, next + count); next < stop; ++next) {
      for (size_t b = 0; b < row_bytes_k; b += 64) hwy::Prefetch(k + next * row_bytes_k + b);
      for (size_t b = 0; b < row_bytes_v; b += 64) hwy::Prefetch(v + next * row_bytes_v + b);
    }
  }
};

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

// s[r * kPStride + t] = scale · q[r] · k[t] for R query rows and keys t in [0, count), K rows d
// apart. Four keys at a time, each K vector loaded once for all R rows; R × 4 lane-wise partial
// dot products are reduced together. pf (may be null) advances pf->per_step rows per 4 keys.
template <size_t R, class KT>
HWY_NOINLINE void ScoreRows(const float* const* q, const KT* HWY_RESTRICT k, size_t count, size_t d,
                            float scale, float* HWY_RESTRICT s, Prefetcher* pf) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  constexpr size_t kJ = R == 1 ? 2 : 1;  // independent FMA chains: at least 8 in flight
  size_t t = 0;
  for (; t + 4 <= count; t += 4) {
    if (pf != nullptr) pf->Rows(pf->per_step);
    VF acc[kJ][R][4];
    for (size_t jj = 0; jj < kJ; ++jj) {
      for (size_t r = 0; r < R; ++r) {
        for (size_t i = 0; i < 4; ++i) acc[jj][r][i] = hn::Zero(df);
      }
    }
    const KT* kt = k + t * d;
    size_t j = 0;
    for (; j + kJ * lanes <= d; j += kJ * lanes) {
      for (size_t jj = 0; jj < kJ; ++jj) {
        const size_t jo = j + jj * lanes;
        VF kv[4];
        for (size_t i = 0; i < 4; ++i) kv[i] = LoadF32(kt + i * d + jo);
        for (size_t r = 0; r < R; ++r) {
          const VF qv = hn::LoadU(df, q[r] + jo);
          for (size_t i = 0; i < 4; ++i) acc[jj][r][i] = hn::MulAdd(qv, kv[i], acc[jj][r][i]);
        }
      }
    }
    for (; j < d; j += lanes) {
      for (size_t r = 0; r < R; ++r) {
        const VF qv = hn::LoadU(df, q[r] + j);
        for (size_t i = 0; i < 4; ++i) {
          acc[0][r][i] = hn::MulAdd(qv, LoadF32(kt + i * d + j), acc[0][r][i]);
        }
      }
    }
    for (size_t r = 0; r < R; ++r) {
      if constexpr (kJ == 2) {
        for (size_t i = 0; i < 4; ++i) acc[0][r][i] = hn::Add(acc[0][r][i], acc[1][r][i]);
      }
      Sum4(acc[0][r], scale, s + r * kPStride + t);
    }
  }
  for (; t < count; ++t) {
    if (pf != nullptr) pf->Rows(1);
    for (size_t r = 0; r < R; ++r) s[r * kPStride + t] = scale * Dot(q[r], k + t * d, d);
  }
}

template <size_t R, class KT>
void ScoreRowsN(size_t n, const float* const* q, const KT* k, size_t count, size_t d, float scale,
                float* s, Prefetcher* pf) {
  if constexpr (R > 1) {
    if (n < R) return ScoreRowsN<R - 1>(n, q, k, count, d, scale, s, pf);
  }
  ScoreRows<R>(q, k, count, d, scale, s, pf);
}

// o[r][j0, j0 + T·lanes) = o · alpha[r] + Σ_{t < count} p[r * kPStride + t] · v[t][j0, …) for
// R query rows: R × T accumulators stay in registers over the keys, each V vector is loaded once.
template <size_t R, size_t T, class VT>
HWY_INLINE void UpdateTile(float* const* o, const float* alpha, const float* HWY_RESTRICT p,
                           const VT* HWY_RESTRICT v, size_t d, size_t count, size_t j0) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF acc[R][T];
  for (size_t r = 0; r < R; ++r) {
    const VF va = hn::Set(df, alpha[r]);
    for (size_t c = 0; c < T; ++c) acc[r][c] = hn::Mul(hn::LoadU(df, o[r] + j0 + c * lanes), va);
  }
  const VT* vt = v + j0;
  for (size_t t = 0; t < count; ++t, vt += d) {
    VF pv[R];
    for (size_t r = 0; r < R; ++r) pv[r] = hn::Set(df, p[r * kPStride + t]);
    for (size_t c = 0; c < T; ++c) {
      const VF x = LoadF32(vt + c * lanes);
      for (size_t r = 0; r < R; ++r) acc[r][c] = hn::MulAdd(pv[r], x, acc[r][c]);
    }
  }
  for (size_t r = 0; r < R; ++r) {
    for (size_t c = 0; c < T; ++c) hn::StoreU(acc[r][c], df, o[r] + j0 + c * lanes);
  }
}

// The last tile of a row, `vecs` < T vectors wide.
template <size_t R, size_t T, class VT>
HWY_INLINE void UpdateTileN(size_t vecs, float* const* o, const float* alpha, const float* p,
                            const VT* v, size_t d, size_t count, size_t j0) {
  if constexpr (T > 1) {
    if (vecs < T) return UpdateTileN<R, T - 1>(vecs, o, alpha, p, v, d, count, j0);
  }
  UpdateTile<R, T>(o, alpha, p, v, d, count, j0);
}

// o[r] = o[r] · alpha[r] + Σ_t p[r][t] · v[t] over the whole head dim, for R query rows.
template <size_t R, class VT>
HWY_NOINLINE void UpdateRows(float* const* o, const float* alpha, const float* p, const VT* v,
                             size_t d, size_t count) {
  constexpr size_t kT = std::min<size_t>(8, std::max<size_t>(1, kAccVecs / R));
  const size_t lanes = hn::Lanes(DF());
  const size_t vecs = d / lanes;
  size_t c = 0;
  for (; c + kT <= vecs; c += kT) UpdateTile<R, kT>(o, alpha, p, v, d, count, c * lanes);
  if (c < vecs) UpdateTileN<R, kT>(vecs - c, o, alpha, p, v, d, count, c * lanes);
}

template <size_t R, class VT>
void UpdateRowsN(size_t n, float* const* o, const float* alpha, const float* p, const VT* v,
                 size_t d, size_t count) {
  if constexpr (R > 1) {
    if (n < R) return UpdateRowsN<R - 1>(n, o, alpha, p, v, d, count);
  }
  UpdateRows<R>(o, alpha, p, v, d, count);
}

// Max over x[0, n) (n a multiple of the lane count).
HWY_INLINE float MaxOf(const float* HWY_RESTRICT x, size_t n) {
  const DF df;
  VF mx = hn::Set(df, kNegInf);
  for (size_t t = 0; t < n; t += hn::Lanes(df)) mx = hn::Max(mx, hn::LoadU(df, x + t));
  return hn::GetLane(hn::MaxOfLanes(df, mx));
}

// Turns one row's block scores s[0, n) (−inf where masked; n a multiple of the lane count) into
// p = exp(s − m_new) in place and updates (m, l); returns alpha = exp(m_old − m_new), o's factor.
HWY_INLINE float SoftmaxBlock(float* HWY_RESTRICT s, size_t n, float* m, float* l) {
  const DF df;
  const float m_new = std::max(*m, MaxOf(s, n));
  if (m_new == kNegInf) {  // nothing visible yet: p = 0, the state stays empty
    std::fill(s, s + n, 0.0f);
    return 1.0f;
  }
  const VF vm = hn::Set(df, m_new);
  VF sum = hn::Zero(df);
  for (size_t t = 0; t < n; t += hn::Lanes(df)) {
    const VF p = hn::Exp(df, hn::Sub(hn::LoadU(df, s + t), vm));
    hn::StoreU(p, df, s + t);
    sum = hn::Add(sum, p);
  }
  const float alpha = std::exp(*m - m_new);  // 0 when the state was empty
  *m = m_new;
  *l = *l * alpha + hn::GetLane(hn::SumOfLanes(df, sum));
  return alpha;
}

// Folds key rows [0, nb) of a block (K, V rows d elements apart; absolute index t0 + t) into the
// states of all rows. s is scratch for rows.n * kPStride probabilities.
template <class KT, class VT>
void DecodeBlock(const KT* HWY_RESTRICT k, const VT* HWY_RESTRICT v, size_t nb, int64_t t0,
                 size_t d, float scale, DecodeRows& rows, float* HWY_RESTRICT s,
                 Prefetcher& prefetch) {
  const size_t lanes = hn::Lanes(DF());
  const size_t n = rows.n;
  size_t a[kMaxDecodeRows], b[kMaxDecodeRows];
  size_t first = nb, last = 0;  // the union of the rows' visible keys in this block
  for (size_t r = 0; r < n; ++r) {
    a[r] = static_cast<size_t>(std::clamp<int64_t>(rows.lo[r] - t0, 0, nb));
    b[r] = static_cast<size_t>(std::clamp<int64_t>(rows.hi[r] - t0, 0, nb));
    if (a[r] < b[r]) first = std::min(first, a[r]), last = std::max(last, b[r]);
  }
  if (first >= last) {
    prefetch.Rows(prefetch.rows);
    return;
  }
  const size_t count = last - first;
  const size_t padded = (count + lanes - 1) / lanes * lanes;
  // Spread over all score tiles' keys: at the rate the block is scored, not faster.
  const size_t tiles = (n + kScoreRows - 1) / kScoreRows;
  prefetch.per_step = std::max<size_t>(1, 4 / tiles);
  for (size_t r0 = 0; r0 < n; r0 += kScoreRows) {
    ScoreRowsN<kScoreRows>(n - r0, rows.q + r0, k + first * d, count, d, scale, s + r0 * kPStride,
                           &prefetch);
  }
  prefetch.Rows(prefetch.rows);  // whatever the keys before `first` did not cover
  float alpha[kMaxDecodeRows];
  for (size_t r = 0; r < n; ++r) {
    float* sr = s + r * kPStride;
    // Keys of the union that this row does not see (causal / window masks of M > 1 rows).
    const size_t lo = std::clamp(a[r], first, last) - first;
    const size_t hi = std::max(std::clamp(b[r], first, last) - first, lo);
    std::fill(sr, sr + lo, kNegInf);
    std::fill(sr + hi, sr + padded, kNegInf);
    alpha[r] = SoftmaxBlock(sr, padded, rows.m[r], rows.l[r]);
  }
  // Masked keys have p = 0: o is multiplied by their (finite) V rows like the tile layout does.
  for (size_t r0 = 0; r0 < n; r0 += kUpdateRows) {
    UpdateRowsN<kUpdateRows>(n - r0, rows.o + r0, alpha + r0, s + r0 * kPStride, v + first * d, d,
                             count);
  }
}

#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
// DecodeBlock straight from the stored rows (fp32 or fp16) of one K/V head.
void DecodeBlockInPlace(const Keys& keys, uint32_t g, int64_t t0, size_t nb, float scale,
                        DecodeRows& rows, float* s, Prefetcher& prefetch) {
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
    DecodeBlock(kh, vh, nb, t0, d, scale, rows, s, prefetch);
  } else if (k16) {
    DecodeBlock(kh, vf, nb, t0, d, scale, rows, s, prefetch);
  } else if (v16) {
    DecodeBlock(kf, vh, nb, t0, d, scale, rows, s, prefetch);
  } else {
    DecodeBlock(kf, vf, nb, t0, d, scale, rows, s, prefetch);
  }
}
#else
void DecodeBlockInPlace(const Keys&, uint32_t, int64_t, size_t, float, DecodeRows&, float*,
                        Prefetcher&) {}
#endif

void AttendDecodeGroup(const Queries& q, const Keys& keys, float scale, int64_t window, uint32_t g,
                       const uint32_t* heads, size_t nheads, const Partial& out, Scratch& scratch) {
  const uint32_t d = q.d;
  DecodeRows rows;
  int64_t lo = keys.end, hi = keys.begin;
  for (size_t h = 0; h < nheads; ++h) {
    for (uint32_t i = 0; i < q.m; ++i) {
      const size_t row = static_cast<size_t>(heads[h]) * q.m + i;
      const KeyRange range = VisibleRange(q.pos0 + i, keys.pos0, window, keys.begin, keys.end);
      const size_t r = rows.n++;
      rows.q[r] = q.q + row * d;
      rows.o[r] = out.o + row * d;
      rows.m[r] = out.m + row;
      rows.l[r] = out.l + row;
      rows.lo[r] = range.lo;
      rows.hi[r] = range.hi;
      if (range.lo < range.hi) lo = std::min(lo, range.lo), hi = std::max(hi, range.hi);
    }
  }
  const size_t block = DecodeBlockRows(d);
  float* s = Grow(scratch.s, rows.n * kPStride);
  // fp32 and fp16 rows are read in place where F16C converts fp16 in registers; everything
  // else (bf16, fp8 with its row scales, or fp16 without F16C) is widened into fp32 blocks
  // first, a block at a time (in L1/L2).
  auto native = [](DType t) { return t == DType::kF32 || t == DType::kF16; };
  const bool in_place = kHaveF16C && native(keys.k.dtype) && native(keys.v.dtype);
  float* kbuf = !in_place && keys.k.dtype != DType::kF32 ? Grow(scratch.k, block * d) : nullptr;
  float* vbuf = !in_place && keys.v.dtype != DType::kF32 ? Grow(scratch.v, block * d) : nullptr;
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
    // With F16C, fp16 rows are converted in registers where they are used, once per block.
    if (in_place) {
      DecodeBlockInPlace(keys, g, t0, nb, scale, rows, s, prefetch);
      continue;
    }
    DecodeBlock(RowsF32(keys.k, g, t0, nb, kbuf), RowsF32(keys.v, g, t0, nb, vbuf), nb, t0, d,
                scale, rows, s, prefetch);
  }
}

// Sparse lists: the visible key rows of rows[0]'s list, gathered into fp32 blocks once for the n
// query rows (one, or a K/V head's rows sharing the list).
void AttendSparseRows(const Queries& q, const Keys& keys, float scale, int64_t window,
                      const size_t* rows, size_t n, const Partial& out, Scratch& scratch) {
  const uint32_t d = q.d;
  const size_t row = rows[0];
  const uint32_t h = static_cast<uint32_t>(row / q.m);
  const uint32_t g = static_cast<uint32_t>(q.head_map[h]);
  const int64_t qpos = q.pos0 + static_cast<int64_t>(row % q.m);
  const int32_t* list = keys.rows + row * keys.stride;
  const int32_t count = keys.counts[row];
  const size_t block = DecodeBlockRows(d);
  float* s = Grow(scratch.s, n * kPStride);
  float* kbuf = Grow(scratch.k, block * d);
  float* vbuf = Grow(scratch.v, block * d);
  DecodeRows state;
  state.n = n;
  for (size_t i = 0; i < n; ++i) {
    state.q[i] = q.q + rows[i] * d;
    state.o[i] = out.o + rows[i] * d;
    state.m[i] = out.m + rows[i];
    state.l[i] = out.l + rows[i];
  }
  Prefetcher none;
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
      for (size_t i = 0; i < n; ++i) {
        state.lo[i] = 0;
        state.hi[i] = static_cast<int64_t>(nb);
      }
      DecodeBlock(kbuf, vbuf, nb, 0, d, scale, state, s, none);
      nb = 0;
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace pion::kernels::cpu
HWY_AFTER_NAMESPACE();
