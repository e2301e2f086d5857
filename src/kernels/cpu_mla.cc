// The CPU backend's MLA kernel (AttendLatent, attention.h): every query head over one set of
// latent rows. Highway compiles this file once per x86 target (foreach_target) and
// HWY_DYNAMIC_DISPATCH picks the best one the CPU supports at run time.
//
// All H_q·M query rows read the same rows, so each block of kLatentBlock rows is widened to
// fp32 once (in L2: 32 rows of 576 values) and then serves every query row, taken in tiles of
// lanes · kTileVecs rows held in lanes (the tile layout of cpu_attention.cc): Q is transposed
// once per call, a tile's scores are rank-1 updates per latent element, the softmax needs no
// horizontal reductions, and O is kept transposed per tile (H_q = 128: 128 × 512 floats, in
// L2). The values are the rows' first dv elements, read in place from the widened block. With
// 128 heads a decode step does ~2·128·(dk + dv) flops per latent row it reads: compute-bound,
// unlike per-head decode.
//
// Sparse lists (one per query token, shared by its heads) are filtered by position, then
// gathered a block at a time into the same widened buffer.
// All scratch is thread_local: concurrent calls on different threads share nothing.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu_mla.cc"
#include <hwy/foreach_target.h>  // must precede highway.h; re-includes this file per target
#include <hwy/highway.h>
//
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/attention.h"
#include "kernels/cpu_common.h"
#include "kernels/cpu_simd-inl.h"

#ifndef PION_KERNELS_CPU_MLA_ONCE_
#define PION_KERNELS_CPU_MLA_ONCE_  // once, not per target
namespace pion::kernels::cpu {

constexpr size_t kLatentBlock = 32;  // latent rows widened at a time

// Per-thread scratch of the MLA kernel (apart from Scratch: a call may follow a per-head one).
struct LatentScratch {
  std::vector<float> qt, ot, s, k, aux;
  std::vector<uint32_t> rows, keys;
};
inline LatentScratch& ThreadLatentScratch() {
  thread_local LatentScratch scratch;
  return scratch;
}

}  // namespace pion::kernels::cpu
#endif  // PION_KERNELS_CPU_MLA_ONCE_

HWY_BEFORE_NAMESPACE();
namespace pion::kernels::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// One latent row → dk fp32 values (its stored layout: attention.h, LatentType).
void WidenLatentRow(const Latent& c, uint32_t t, float* HWY_RESTRICT dst) {
  const uint8_t* src = c.Row(t);
  switch (c.type) {
    case LatentType::kF32:
      std::memcpy(dst, src, size_t{c.dk} * sizeof(float));
      return;
    case LatentType::kF16:
      return HalfToFloat(src, c.dk, dst);
    case LatentType::kBF16:
      return simd::HWY_NAMESPACE::WidenBf16(src, c.dk, dst);
    case LatentType::kFP8: {
      float scale;
      std::memcpy(&scale, src, 4);
      return Fp8ToFloat(src + 4, c.dk, scale, dst);
    }
    case LatentType::kFP8DsMla: {
      const uint32_t groups = c.dv / 128;
      for (uint32_t g = 0; g < groups; ++g) {
        float scale;
        std::memcpy(&scale, src + c.dv + 4 * g, 4);
        Fp8ToFloat(src + 128 * g, 128, scale, dst + 128 * g);
      }
      return simd::HWY_NAMESPACE::WidenBf16(src + c.dv + 4 * groups, c.dk - c.dv, dst + c.dv);
    }
  }
}

// Rows [t0, t0 + n) as fp32 [n][dk]: in place for fp32, widened into buf otherwise.
const float* LatentRowsF32(const Latent& c, size_t t0, size_t n, float* buf) {
  if (c.type == LatentType::kF32) {
    return reinterpret_cast<const float*>(c.Row(static_cast<uint32_t>(t0)));
  }
  if (c.type == LatentType::kF16) {
    HalfToFloat(c.Row(static_cast<uint32_t>(t0)), n * c.dk, buf);
  } else if (c.type == LatentType::kBF16) {
    simd::HWY_NAMESPACE::WidenBf16(c.Row(static_cast<uint32_t>(t0)), n * c.dk, buf);
  } else {
    for (size_t r = 0; r < n; ++r) {
      WidenLatentRow(c, static_cast<uint32_t>(t0 + r), buf + r * c.dk);
    }
  }
  return buf;
}

// The running state of `n` query rows (global indices rows[0, n)) in tiles of rt lanes: their
// transposed queries, softmax state, visible key ranges and transposed outputs.
class LatentTiles {
 public:
  LatentTiles(const LatentQueries& q, const LatentKeys& keys, int64_t window, const uint32_t* rows,
              size_t n, LatentScratch& scratch)
      : rows_(rows), n_(n), dk_(keys.c.dk), dv_(keys.c.dv) {
    lanes_ = hn::Lanes(DF());
    rt_ = lanes_ * kTileVecs;
    tiles_ = (n + rt_ - 1) / rt_;
    const size_t lanes_all = tiles_ * rt_;
    qt_ = Grow(scratch.qt, lanes_all * dk_);
    ot_ = Grow(scratch.ot, lanes_all * dv_);
    float* aux = Grow(scratch.aux, 5 * lanes_all);
    lo_ = aux;  // visible key rows [lo, hi) per lane, as floats (exact below 2^24)
    hi_ = aux + lanes_all;
    m_ = aux + 2 * lanes_all;
    l_ = aux + 3 * lanes_all;
    alpha_ = aux + 4 * lanes_all;
    std::fill(ot_, ot_ + lanes_all * dv_, 0.0f);
    all_lo_ = keys.begin;
    all_hi_ = keys.end;
    for (size_t c = 0; c < lanes_all; ++c) {
      float* qt = qt_ + (c / rt_) * dk_ * rt_ + c % rt_;
      m_[c] = kNegInf;
      l_[c] = 0.0f;
      if (c >= n) {  // padding lanes: zero queries, never masked, discarded
        for (uint32_t j = 0; j < dk_; ++j) qt[j * rt_] = 0.0f;
        lo_[c] = static_cast<float>(keys.begin);
        hi_[c] = static_cast<float>(keys.end);
        continue;
      }
      const float* qr = q.q + static_cast<size_t>(rows[c]) * dk_;
      for (uint32_t j = 0; j < dk_; ++j) qt[j * rt_] = qr[j];
      const KeyRange range = VisibleRange(q.pos0 + static_cast<int64_t>(rows[c] % q.m), keys.pos0,
                                          window, keys.begin, keys.end);
      lo_[c] = static_cast<float>(range.lo);
      hi_[c] = static_cast<float>(range.hi);
      all_lo_ = std::max(all_lo_, range.lo);
      all_hi_ = std::min(all_hi_, range.hi);
    }
  }

  // Folds in nb widened rows k [nb][dk] (their first dv values the values). `t0`: the rows'
  // index, for the per-lane ranges (masked when the block is not inside every lane's range);
  // -1 for gathered rows the caller already filtered (never masked).
  void Block(const float* k, size_t nb, int64_t t0, float scale, float* s) {
    const DF df;
    const VF vscale = hn::Set(df, scale);
    const VF neg_inf = hn::Set(df, kNegInf);
    const bool masked = t0 >= 0 && (t0 < all_lo_ || t0 + static_cast<int64_t>(nb) > all_hi_);
    for (size_t tile = 0; tile < tiles_; ++tile) {
      const size_t base = tile * rt_;
      const size_t nv = (std::min(n_ - base, rt_) + lanes_ - 1) / lanes_;
      TileScoresN<kTileVecs>(nv, k, nb, dk_, qt_ + tile * dk_ * rt_, rt_, s);
      for (size_t c = 0; c < nv; ++c) {
        const size_t off = c * lanes_, at = base + off;
        const VF vlo = hn::LoadU(df, lo_ + at);
        const VF vhi = hn::LoadU(df, hi_ + at);
        VF mx = neg_inf;
        for (size_t t = 0; t < nb; ++t) {
          VF x = hn::Mul(hn::LoadU(df, s + t * rt_ + off), vscale);
          if (masked) {
            const VF pos = hn::Set(df, static_cast<float>(t0 + static_cast<int64_t>(t)));
            x = hn::IfThenElse(hn::And(hn::Ge(pos, vlo), hn::Lt(pos, vhi)), x, neg_inf);
          }
          hn::StoreU(x, df, s + t * rt_ + off);
          mx = hn::Max(mx, x);
        }
        const VF m_old = hn::LoadU(df, m_ + at);
        const VF m_new = hn::Max(m_old, mx);
        // Lanes with no visible key yet subtract 0 instead of -inf: p and alpha become 0, not NaN.
        const VF m_use = hn::IfThenElse(hn::Eq(m_new, neg_inf), hn::Zero(df), m_new);
        const VF a = hn::Exp(df, hn::Sub(m_old, m_use));
        VF sum = hn::Zero(df);
        for (size_t t = 0; t < nb; ++t) {
          const VF p = hn::Exp(df, hn::Sub(hn::LoadU(df, s + t * rt_ + off), m_use));
          hn::StoreU(p, df, s + t * rt_ + off);
          sum = hn::Add(sum, p);
        }
        hn::StoreU(m_new, df, m_ + at);
        hn::StoreU(hn::MulAdd(hn::LoadU(df, l_ + at), a, sum), df, l_ + at);
        hn::StoreU(a, df, alpha_ + at);
      }
      TileAccumulateN<kTileVecs>(nv, k, nb, dv_, dk_, s, alpha_ + base, rt_,
                                 ot_ + tile * dv_ * rt_);
    }
  }

  // The union of the lanes' visible ranges.
  std::pair<int64_t, int64_t> Span() const {
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
    for (size_t c = 0; c < n_; ++c) {
      if (lo_[c] < hi_[c]) {
        lo = std::min<int64_t>(lo, static_cast<int64_t>(lo_[c]));
        hi = std::max<int64_t>(hi, static_cast<int64_t>(hi_[c]));
      }
    }
    return {lo, hi};
  }

  void Store(const Partial& out) const {
    for (size_t c = 0; c < n_; ++c) {
      const size_t row = rows_[c];
      const float* ot = ot_ + (c / rt_) * dv_ * rt_ + c % rt_;
      const bool empty = m_[c] == kNegInf;
      out.m[row] = m_[c];
      out.l[row] = empty ? 0.0f : l_[c];
      float* o = out.o + row * dv_;
      for (uint32_t j = 0; j < dv_; ++j) o[j] = empty ? 0.0f : ot[j * rt_];
    }
  }

  size_t rt() const { return rt_; }

 private:
  const uint32_t* rows_;
  size_t n_;
  uint32_t dk_, dv_;
  size_t lanes_ = 0, rt_ = 0, tiles_ = 0;
  float *qt_, *ot_, *lo_, *hi_, *m_, *l_, *alpha_;
  int64_t all_lo_ = 0, all_hi_ = 0;
};

void AttendLatent(const LatentQueries& q, const LatentKeys& keys, float scale, int64_t window,
                  const Partial& out) {
  LatentScratch& scratch = ThreadLatentScratch();
  ClearPartial(out);
  const Latent& c = keys.c;
  float* kbuf = c.type != LatentType::kF32 || keys.rows != nullptr
                    ? Grow(scratch.k, kLatentBlock * c.dk)
                    : nullptr;
  std::vector<uint32_t>& rows = scratch.rows;
  if (keys.rows == nullptr) {  // dense: every query row over one range of rows
    rows.resize(static_cast<size_t>(q.hq) * q.m);
    for (size_t r = 0; r < rows.size(); ++r) rows[r] = static_cast<uint32_t>(r);
    LatentTiles tiles(q, keys, window, rows.data(), rows.size(), scratch);
    float* s = Grow(scratch.s, kLatentBlock * tiles.rt());
    const auto [lo, hi] = tiles.Span();
    for (int64_t t0 = lo; t0 < hi; t0 += kLatentBlock) {
      const size_t nb = static_cast<size_t>(std::min<int64_t>(kLatentBlock, hi - t0));
      tiles.Block(LatentRowsF32(c, static_cast<size_t>(t0), nb, kbuf), nb, t0, scale, s);
    }
    return tiles.Store(out);
  }
  // Sparse: per query token, its heads over its list, filtered by position and gathered.
  std::vector<uint32_t>& list = scratch.keys;
  for (uint32_t i = 0; i < q.m; ++i) {
    rows.resize(q.hq);
    for (uint32_t h = 0; h < q.hq; ++h) rows[h] = h * q.m + i;
    const int64_t qpos = q.pos0 + i;
    list.clear();
    const int32_t* given = keys.rows + static_cast<size_t>(i) * keys.stride;
    for (int32_t j = 0; j < keys.counts[i]; ++j) {
      const uint32_t t = static_cast<uint32_t>(given[j]);
      if (Visible(qpos, keys.pos0 + t, window)) list.push_back(t);
    }
    // The gathered rows are visible to every lane: blocks of them are never masked (t0 = -1).
    LatentTiles tiles(q, keys, window, rows.data(), rows.size(), scratch);
    float* s = Grow(scratch.s, kLatentBlock * tiles.rt());
    for (size_t j0 = 0; j0 < list.size(); j0 += kLatentBlock) {
      const size_t nb = std::min(kLatentBlock, list.size() - j0);
      for (size_t r = 0; r < nb; ++r) WidenLatentRow(c, list[j0 + r], kbuf + r * c.dk);
      tiles.Block(kbuf, nb, -1, scale, s);
    }
    tiles.Store(out);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace pion::kernels::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pion::kernels::cpu {

HWY_EXPORT(AttendLatent);

void AttendLatentDispatch(const LatentQueries& q, const LatentKeys& keys, float scale,
                          int64_t window, const Partial& out) {
  HWY_DYNAMIC_DISPATCH(AttendLatent)(q, keys, scale, window, out);
}

}  // namespace pion::kernels::cpu
#endif  // HWY_ONCE
