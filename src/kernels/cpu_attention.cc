// The CPU attention backend. Highway compiles this file once per x86 target (foreach_target) and
// HWY_DYNAMIC_DISPATCH picks the best one the CPU supports at run time.
//
// Attend runs an online softmax over blocks of key rows, per K/V head, with every query row that
// reads that head (its GQA group) processed together so each K/V row is fetched from memory once
// per call. Two layouts:
//   - few rows (decode, M=1, up to kMaxDecodeRows rows per K/V head; and sparse row lists): head
//     dim in lanes, in cpu_decode.cc. Memory-bound; K and V are read at close to the
//     single-thread read bandwidth.
//   - many rows (prefill, M >= lanes): query rows in lanes, here. Q is transposed once per row
//     tile, so a tile of scores is a rank-1 update per head-dim element and the softmax needs no
//     horizontal reductions; O is kept transposed and rescaled per lane.
// fp16 and bf16 K/V are converted to fp32 one block at a time here (F16C on AVX2/AVX-512 for
// fp16, integer widening for bf16).
// All scratch is thread_local: concurrent calls on different threads share nothing.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu_attention.cc"
#include <hwy/foreach_target.h>  // must precede highway.h; re-includes this file per target
#include <hwy/highway.h>
//
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/attention.h"
#include "kernels/cpu_common.h"
#include "kernels/cpu_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pion::kernels::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// ---- tile layout: many query rows in lanes ----------------------------------------------------

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
  float* kbuf = keys.k.dtype != DType::kF32 ? Grow(scratch.k, block * d) : nullptr;
  float* vbuf = keys.v.dtype != DType::kF32 ? Grow(scratch.v, block * d) : nullptr;

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
    TileAccumulateN<kTileVecs>(nv, v, nb, d, d, s, alpha, rt, ot);
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
  std::vector<uint32_t>& heads = scratch.idx;
  auto heads_of = [&](uint32_t g) {  // the query heads of K/V head g, into `heads`
    heads.clear();
    for (uint32_t h = 0; h < q.hq; ++h) {
      if (static_cast<uint32_t>(q.head_map[h]) == g) heads.push_back(h);
    }
  };
  if (keys.rows != nullptr) {
    if (keys.shared_lists && q.m == 1) {  // a K/V head's rows read their one list together
      size_t rows[kMaxDecodeRows];
      for (uint32_t g = 0; g < keys.k.heads; ++g) {
        heads_of(g);
        for (size_t i0 = 0; i0 < heads.size(); i0 += kMaxDecodeRows) {
          const size_t n = std::min(kMaxDecodeRows, heads.size() - i0);
          for (size_t i = 0; i < n; ++i) rows[i] = heads[i0 + i];
          AttendSparseRows(q, keys, scale, window, rows, n, out, scratch);
        }
      }
      return;
    }
    for (size_t row = 0; row < static_cast<size_t>(q.hq) * q.m; ++row) {
      AttendSparseRows(q, keys, scale, window, &row, 1, out, scratch);
    }
    return;
  }
  if (keys.begin >= keys.end) return;
  const size_t lanes = hn::Lanes(DF());
  const size_t rt = lanes * kTileVecs;
  std::vector<uint32_t>& rows = scratch.rows;
  for (uint32_t g = 0; g < keys.k.heads; ++g) {
    heads_of(g);
    if (heads.empty()) continue;
    const size_t n = heads.size() * q.m;
    if (n < lanes && n <= kMaxDecodeRows) {
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
  float* kbuf = keys.k.dtype != DType::kF32 ? Grow(scratch.k, block * d) : nullptr;
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
      k.dtype != DType::kF32 ? Grow(scratch.k, static_cast<size_t>(out.block) * d) : nullptr;
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
  void AttendLatent(const LatentQueries& q, const LatentKeys& keys, float scale, int64_t window,
                    const Partial& out) const override {
    AttendLatentDispatch(q, keys, scale, window, out);
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
