// RunMla (executor.h): the MLA forms over a slot of latent rows — dense (decode, and MTP rows
// causal among themselves), caller-sparse per query token, and fused with the client's suffix
// latents — split across threads and merged exactly, with the same receipt as every form.
//
// With many query heads an MLA pass is compute-bound (every head reads every latent row: ~2·H_q·
// (dk + dv) flops a row), so the split is sized by work, not only by bytes read.
#include <algorithm>
#include <chrono>
#include <vector>

#include "attention/executor.h"
#include "attention/visibility.h"

namespace pion::attention {
namespace {

using kernels::Latent;
using kernels::LatentKeys;
using kernels::LatentQueries;
using kernels::Partial;

struct PartialBuf {
  std::vector<float> m, l, o;
  PartialBuf(size_t n, uint32_t d) : m(n), l(n), o(n * d) {}
  Partial View(uint32_t d) { return {m.data(), l.data(), o.data(), m.size(), d}; }
};

using Clock = std::chrono::steady_clock;
double Micros(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// Pieces of a pass over `rows` latent rows: SplitsFor over the bytes read, or over the work when
// that is larger (a multiply-add counted as an eighth of a byte: about what a core does per byte
// it streams).
uint32_t MlaSplits(const LatentQueries& q, const Latent& c, uint64_t rows, int threads) {
  const uint64_t per_row =
      std::max<uint64_t>(c.row_bytes(), uint64_t{q.hq} * q.m * (c.dk + c.dv) / 8);
  return SplitsFor(rows * per_row, rows, threads);
}

// Every query row over the rows of `c` (at positions pos0..) it may see, split by row range.
void DensePass(const kernels::AttentionKernels& kern, const Parallel& par, const LatentQueries& q,
               const Latent& c, int64_t pos0, float scale, int64_t window, const Partial& out,
               Receipt* r) {
  const auto visible = VisibleRows(q.pos0, q.pos0 + q.m - 1, window, pos0, c.rows);
  const uint32_t begin = visible.first, end = visible.second;
  if (begin >= end) return kernels::ClearPartial(out);
  const uint64_t rows = end - begin;
  const uint32_t pieces = MlaSplits(q, c, rows, par.threads);
  r->splits = std::max(r->splits, pieces);
  LatentKeys keys;
  keys.c = c;
  keys.pos0 = pos0;
  keys.begin = begin;
  keys.end = end;
  if (pieces == 1) return kern.AttendLatent(q, keys, scale, window, out);
  std::vector<PartialBuf> parts;
  parts.reserve(pieces - 1);
  for (uint32_t i = 1; i < pieces; ++i) parts.emplace_back(out.n, out.d);
  const auto t0 = Clock::now();
  std::vector<double> start_us(pieces), took_us(pieces);
  par.For(pieces, [&](size_t i) {
    const auto a = Clock::now();
    LatentKeys piece = keys;
    piece.begin = static_cast<uint32_t>(begin + rows * i / pieces);
    piece.end = static_cast<uint32_t>(begin + rows * (i + 1) / pieces);
    kern.AttendLatent(q, piece, scale, window, i == 0 ? out : parts[i - 1].View(out.d));
    start_us[i] = Micros(t0, a);
    took_us[i] = Micros(a, Clock::now());
  });
  const auto m0 = Clock::now();
  for (auto& p : parts) kernels::MergePartial(out, p.View(out.d));
  r->merge_us += Micros(m0, Clock::now());
  r->piece_start_max_us =
      std::max(r->piece_start_max_us, *std::max_element(start_us.begin(), start_us.end()));
  r->piece_max_us = std::max(r->piece_max_us, *std::max_element(took_us.begin(), took_us.end()));
}

// Caller lists, one per query token: each token's list cut into pieces by position (the heads
// of a token always together), merged exactly. The receipt counts the listed rows each token
// may see.
void SparsePass(const kernels::AttentionKernels& kern, const Parallel& par, const LatentQueries& q,
                const Plan& plan, const Latent& c, float scale, const Partial& out, Receipt* r) {
  uint64_t listed = 0;
  for (uint32_t i = 0; i < q.m; ++i) listed += static_cast<uint64_t>(plan.counts[i]);
  const uint32_t pieces = listed == 0 ? 1 : MlaSplits(q, c, (listed + q.m - 1) / q.m, par.threads);
  r->splits = std::max(r->splits, pieces);
  // Piece p takes positions [cnt·p/P, cnt·(p+1)/P) of each token's list, copied compactly.
  std::vector<std::vector<int32_t>> rows(pieces), counts(pieces);
  for (uint32_t p = 0; p < pieces; ++p) {
    rows[p].assign(static_cast<size_t>(q.m) * std::max<uint32_t>(plan.stride, 1), 0);
    counts[p].assign(q.m, 0);
    for (uint32_t i = 0; i < q.m; ++i) {
      const int64_t cnt = plan.counts[i];
      const int64_t a = cnt * p / pieces, b = cnt * (p + 1) / pieces;
      const int32_t* list = plan.rows + static_cast<size_t>(i) * plan.stride;
      std::copy(list + a, list + b, rows[p].begin() + static_cast<size_t>(i) * plan.stride);
      counts[p][i] = static_cast<int32_t>(b - a);
    }
  }
  std::vector<PartialBuf> parts;
  parts.reserve(pieces - 1);
  for (uint32_t i = 1; i < pieces; ++i) parts.emplace_back(out.n, out.d);
  par.For(pieces, [&](size_t p) {
    LatentKeys keys;
    keys.c = c;
    keys.rows = rows[p].data();
    keys.counts = counts[p].data();
    keys.stride = plan.stride;
    kern.AttendLatent(q, keys, scale, plan.window, p == 0 ? out : parts[p - 1].View(out.d));
  });
  for (auto& part : parts) kernels::MergePartial(out, part.View(out.d));
  for (uint32_t i = 0; i < q.m; ++i) {
    const auto visible = VisibleFor(q.pos0 + i, plan.window, 0, c.rows);
    const uint32_t b = visible.first, e = visible.second;
    uint64_t seen = 0;
    const int32_t* list = plan.rows + static_cast<size_t>(i) * plan.stride;
    for (int32_t j = 0; j < plan.counts[i]; ++j) {
      seen += static_cast<uint32_t>(list[j]) >= b && static_cast<uint32_t>(list[j]) < e;
    }
    if (seen < e - b) r->exact = false;
    for (uint32_t h = 0; h < q.hq; ++h) r->support[h] += seen;
    r->rows_attended += seen * q.hq;
  }
  r->omitted_mass_bound = r->exact ? 0 : 1;  // nothing scored the rows left out
}

}  // namespace

Status RunMla(const kernels::AttentionKernels& kern, const Parallel& par, Plan plan,
              const Latent& c, float* out, float* lse, Receipt* r) {
  const auto t0 = Clock::now();
  if (!IsMla(plan.form) || plan.q.d != c.dk || plan.dv != c.dv) {
    return Error("an MLA plan needs latent rows of its query width");
  }
  const float scale = plan.scale;
  const uint32_t n = c.rows;
  const uint32_t s_suf = plan.latent_suffix.rows;
  const bool fused = plan.form == Form::kMlaFused;
  LatentQueries q{plan.q.q, plan.q.hq, plan.q.m, plan.q.pos0};
  if (fused) q.pos0 = static_cast<int64_t>(n) + s_suf - q.m;
  const size_t nrows = static_cast<size_t>(q.hq) * q.m;
  *r = Receipt{};
  r->support.assign(q.hq, 0);
  PartialBuf acc(nrows, plan.dv);
  const Partial out_p = acc.View(plan.dv);
  for (uint32_t i = 0; i < q.m; ++i) {
    r->visible_rows += VisibleCount(q.pos0 + i, plan.window, n) * q.hq;
  }
  if (plan.form == Form::kMlaSparse) {
    SparsePass(kern, par, q, plan, c, scale, out_p, r);
  } else {
    DensePass(kern, par, q, c, 0, scale, plan.window, out_p, r);
    r->rows_attended = r->visible_rows;
    for (uint32_t i = 0; i < q.m; ++i) {
      const uint64_t seen = VisibleCount(q.pos0 + i, plan.window, n);
      for (uint32_t h = 0; h < q.hq; ++h) r->support[h] += seen;
    }
  }
  if (fused) {  // the suffix: dense and causal, at positions N..N+S−1, merged in
    PartialBuf suf(nrows, plan.dv);
    Receipt ignored;
    DensePass(kern, par, q, plan.latent_suffix, n, scale, plan.window, suf.View(plan.dv), &ignored);
    kernels::MergePartial(out_p, suf.View(plan.dv));
    for (uint32_t i = 0; i < q.m; ++i) {
      const auto visible = VisibleFor(q.pos0 + i, plan.window, n, s_suf);
      const uint64_t seen = visible.second - visible.first;
      r->rows_attended += seen * q.hq;
      r->visible_rows += seen * q.hq;
      for (uint32_t h = 0; h < q.hq; ++h) r->support[h] += seen;
    }
  }
  kernels::FinalizePartial(out_p, out, lse);
  r->micros = Micros(t0, Clock::now());
  return Status::Ok();
}

}  // namespace pion::attention
