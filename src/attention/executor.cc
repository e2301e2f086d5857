#include "attention/executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

#include "attention/visibility.h"

namespace pion::attention {

using kernels::Keys;
using kernels::Partial;
using kernels::Queries;
using kernels::Tensor3;

std::string_view FormName(Form f) {
  switch (f) {
    case Form::kDense:
      return "dense";
    case Form::kTopK:
      return "topk";
    case Form::kFused:
      return "fused";
    case Form::kSparse:
      return "sparse";
    case Form::kSparseAuto:
      return "sparse_auto";
    case Form::kSparseAutoFused:
      return "sparse_auto_fused";
    case Form::kMla:
      return "mla";
    case Form::kMlaSparse:
      return "mla_sparse";
    case Form::kMlaFused:
      return "mla_fused";
  }
  return "unknown";
}

void Summarize(const kernels::AttentionKernels& kern, const Parallel& par, const Tensor3& k,
               const kernels::BlockSummaries& out) {
  const uint32_t pieces = std::max(1u, std::min<uint32_t>(k.heads, std::max(par.threads, 1)));
  par.For(pieces, [&](size_t i) {
    const uint32_t h0 = static_cast<uint32_t>(k.heads * i / pieces);
    const uint32_t h1 = static_cast<uint32_t>(k.heads * (i + 1) / pieces);
    if (h0 == h1) return;
    Tensor3 part = k;  // heads [h0, h1): their rows, and for fp8 their scales
    part.data = k.Row(h0, 0);
    part.heads = h1 - h0;
    if (k.scales != nullptr) part.scales = k.scales + static_cast<size_t>(h0) * k.rows;
    kernels::BlockSummaries s = out;
    const size_t at = static_cast<size_t>(h0) * out.nblocks * out.d;
    s.mean += at;
    s.min += at;
    s.max += at;
    s.heads = h1 - h0;
    kern.Summarize(part, s);
  });
}

uint32_t SplitsFor(uint64_t bytes_read, uint64_t rows, int threads) {
  constexpr uint64_t kMinBytesPerPiece = 256 << 10;  // below this, a thread hop costs more
  constexpr uint64_t kMinRowsPerPiece = 64;
  if (threads <= 1) return 1;
  // A few pieces per thread, claimed as threads come free: a thread that starts late (woken
  // late, or preempted on a busy box) costs the pass a fraction of a piece, not half of it.
  constexpr uint64_t kPiecesPerThread = 4;
  uint64_t pieces = std::min<uint64_t>(threads * kPiecesPerThread, bytes_read / kMinBytesPerPiece);
  pieces = std::min<uint64_t>(pieces, rows / kMinRowsPerPiece);
  return static_cast<uint32_t>(std::max<uint64_t>(pieces, 1));
}

namespace {

// Owned storage for a Partial of n rows.
struct PartialBuf {
  std::vector<float> m, l, o;
  PartialBuf(size_t n, uint32_t d) : m(n), l(n), o(n * d) {}
  Partial View(uint32_t d) { return {m.data(), l.data(), o.data(), m.size(), d}; }
};

// Dense attention of every query row over rows [0, k.rows) of k/v at positions pos0..,
// split across threads by key range and merged exactly.
void DensePass(const kernels::AttentionKernels& kern, const Parallel& par, const Queries& q,
               const Tensor3& k, const Tensor3& v, int64_t pos0, float scale, int64_t window,
               const Partial& out, Receipt* r) {
  // Not a structured binding: the lambda below captures it (clang 14 rejects that).
  const auto visible = VisibleRows(q.pos0, q.pos0 + q.m - 1, window, pos0, k.rows);
  const auto begin = visible.first, end = visible.second;
  if (begin >= end) return kernels::ClearPartial(out);
  const uint64_t rows = end - begin;
  const uint64_t bytes =
      rows * k.heads * k.d * (kernels::DTypeSize(k.dtype) + kernels::DTypeSize(v.dtype));
  const uint32_t pieces = SplitsFor(bytes, rows, par.threads);
  r->splits = std::max(r->splits, pieces);
  Keys keys{k, v, pos0, begin, end};
  if (pieces == 1) return kern.Attend(q, keys, scale, window, out);
  std::vector<PartialBuf> parts;
  parts.reserve(pieces - 1);
  for (uint32_t i = 1; i < pieces; ++i) parts.emplace_back(out.n, out.d);
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  std::vector<double> start_us(pieces), took_us(pieces);
  par.For(pieces, [&](size_t i) {
    const auto a = Clock::now();
    Keys piece = keys;
    piece.begin = static_cast<uint32_t>(begin + rows * i / pieces);
    piece.end = static_cast<uint32_t>(begin + rows * (i + 1) / pieces);
    kern.Attend(q, piece, scale, window, i == 0 ? out : parts[i - 1].View(out.d));
    start_us[i] = std::chrono::duration<double, std::micro>(a - t0).count();
    took_us[i] = std::chrono::duration<double, std::micro>(Clock::now() - a).count();
  });
  const auto m0 = Clock::now();
  for (auto& p : parts) kernels::MergePartial(out, p.View(out.d));
  r->merge_us += std::chrono::duration<double, std::micro>(Clock::now() - m0).count();
  r->piece_start_max_us =
      std::max(r->piece_start_max_us, *std::max_element(start_us.begin(), start_us.end()));
  r->piece_max_us = std::max(r->piece_max_us, *std::max_element(took_us.begin(), took_us.end()));
}

// Query rows of head h only (a view into q).
Queries HeadView(const Queries& q, uint32_t h) {
  Queries one = q;
  one.q = q.q + static_cast<size_t>(h) * q.m * q.d;
  one.hq = 1;
  one.head_map = q.head_map + h;
  return one;
}

Partial RowsView(const Partial& p, size_t first, size_t n) {
  return {p.m + first, p.l + first, p.o + first * p.d, n, p.d};
}

// Sparse attention with per-query-row lists, parallel over query heads.
void SparsePass(const kernels::AttentionKernels& kern, const Parallel& par, const Queries& q,
                const Tensor3& k, const Tensor3& v, const std::vector<int32_t>& rows,
                const std::vector<int32_t>& counts, uint32_t stride, float scale, int64_t window,
                const Partial& out, bool shared_lists = false) {
  // Threads take runs of whole query heads; with shared lists and a contiguous GQA map, runs
  // of whole K/V head groups, so no group's list is gathered by two threads.
  uint32_t unit = 1;
  if (shared_lists && k.heads > 0 && q.hq % k.heads == 0) {
    const uint32_t group = q.hq / k.heads;
    bool contiguous = true;
    for (uint32_t h = 0; h < q.hq; ++h) {
      contiguous = contiguous && static_cast<uint32_t>(q.head_map[h]) == h / group;
    }
    if (contiguous) unit = group;
  }
  const uint32_t units = q.hq / unit;
  const size_t groups = std::min<size_t>(units, std::max(par.threads, 1));
  par.For(groups, [&](size_t g) {
    const uint32_t h0 = unit * static_cast<uint32_t>(units * g / groups);
    const uint32_t h1 = unit * static_cast<uint32_t>(units * (g + 1) / groups);
    if (h0 == h1) return;
    Queries sub = HeadView(q, h0);
    sub.hq = h1 - h0;
    const size_t r0 = static_cast<size_t>(h0) * q.m;
    Keys keys{k, v, 0, 0, 0};
    keys.rows = rows.data() + r0 * stride;
    keys.counts = counts.data() + r0;
    keys.stride = stride;
    keys.shared_lists = shared_lists;
    kern.Attend(sub, keys, scale, window, RowsView(out, r0, static_cast<size_t>(sub.hq) * q.m));
  });
}

void TopK(const kernels::AttentionKernels& kern, const Parallel& par, const Queries& q,
          const Tensor3& k, const Tensor3& v, uint32_t top_k, float scale, int64_t window,
          const Partial& out, Receipt* r) {
  const size_t nrows = static_cast<size_t>(q.hq) * q.m;
  std::vector<int32_t> rows(nrows * top_k);
  std::vector<int32_t> counts(nrows);
  std::vector<double> omitted(nrows, 0.0);
  std::vector<uint8_t> exact(nrows, 1);
  const size_t groups = std::min<size_t>(nrows, std::max(par.threads, 1));
  par.For(groups, [&](size_t g) {
    std::vector<float> scores;
    std::vector<int32_t> idx;
    for (size_t row = nrows * g / groups; row < nrows * (g + 1) / groups; ++row) {
      const uint32_t h = static_cast<uint32_t>(row / q.m), i = static_cast<uint32_t>(row % q.m);
      const int64_t p = q.pos0 + i;
      const auto visible = VisibleFor(p, window, 0, k.rows);  // captured below: no binding
      const auto b = visible.first, e = visible.second;
      counts[row] = 0;
      if (b >= e) continue;
      Queries one = HeadView(q, h);
      one.q += static_cast<size_t>(i) * q.d;
      one.m = 1;
      one.pos0 = p;
      scores.resize(e - b);
      kern.Scores(one, Keys{k, v, 0, b, e}, scale, window, scores.data());
      idx.resize(e - b);
      std::iota(idx.begin(), idx.end(), static_cast<int32_t>(b));
      const size_t keep = std::min<size_t>(top_k, idx.size());
      if (keep < idx.size()) {
        exact[row] = 0;
        std::nth_element(idx.begin(), idx.begin() + keep, idx.end(),
                         [&](int32_t x, int32_t y) { return scores[x - b] > scores[y - b]; });
        // Exact omitted mass: the softmax weight of the keys left out.
        float mx = -std::numeric_limits<float>::infinity();
        for (float s : scores) mx = std::max(mx, s);
        double all = 0, kept = 0;
        for (float s : scores) all += std::exp(static_cast<double>(s) - mx);
        for (size_t j = 0; j < keep; ++j)
          kept += std::exp(static_cast<double>(scores[idx[j] - b]) - mx);
        omitted[row] = all > 0 ? (all - kept) / all : 0;
      }
      std::sort(idx.begin(), idx.begin() + keep);
      std::copy(idx.begin(), idx.begin() + keep, rows.begin() + row * top_k);
      counts[row] = static_cast<int32_t>(keep);
    }
  });
  SparsePass(kern, par, q, k, v, rows, counts, top_k, scale, window, out);
  double om = 0;
  for (size_t row = 0; row < nrows; ++row) {
    r->rows_attended += counts[row];
    r->support[row / q.m] += counts[row];
    r->exact = r->exact && exact[row];
    om += omitted[row];
  }
  r->omitted_mass_estimate = nrows ? om / nrows : 0;
  r->omitted_mass_bound = r->omitted_mass_estimate;  // exact scores: the share itself
  r->omitted_mass_exact = r->omitted_mass_estimate;
}

// AUDIT: per query head (M = 1), the log of Σ exp(score) over its visible prefix keys
// [lo, hi) that its list (rows[h·stride ..], counts[h]) left out — every visible key scored
// with the kernels' own Scores; −inf where none was left out.
std::vector<double> LogLeftOutExact(const kernels::AttentionKernels& kern, const Parallel& par,
                                    const Queries& q, const Tensor3& k, const Tensor3& v,
                                    float scale, int64_t window, uint32_t lo, uint32_t hi,
                                    const int32_t* rows, const int32_t* counts, size_t stride) {
  std::vector<double> out(q.hq, -std::numeric_limits<double>::infinity());
  if (lo >= hi) return out;
  const size_t groups = std::min<size_t>(q.hq, std::max(par.threads, 1));
  par.For(groups, [&](size_t g) {
    std::vector<float> scores(hi - lo);
    std::vector<uint8_t> kept(hi - lo);
    for (size_t h = q.hq * g / groups; h < q.hq * (g + 1) / groups; ++h) {
      Queries one = HeadView(q, static_cast<uint32_t>(h));
      one.m = 1;
      kern.Scores(one, Keys{k, v, 0, lo, hi}, scale, window, scores.data());
      std::fill(kept.begin(), kept.end(), 0);
      for (int32_t j = 0; j < counts[h]; ++j) {
        const int64_t t = rows[h * stride + j];
        if (t >= lo && t < hi) kept[t - lo] = 1;
      }
      out[h] = LogSumExpLeftOut(scores.data(), kept.data(), hi - lo);
    }
  });
  return out;
}

// Caller-chosen rows (M = 1): lists as given; the receipt counts the visible ones.
void CallerSparse(const kernels::AttentionKernels& kern, const Parallel& par, const Plan& plan,
                  const Tensor3& k, const Tensor3& v, float scale, const Partial& out, Receipt* r,
                  std::vector<double>* log_left) {
  const Queries& q = plan.q;
  std::vector<int32_t> rows(plan.rows, plan.rows + static_cast<size_t>(q.hq) * plan.stride);
  std::vector<int32_t> counts(plan.counts, plan.counts + q.hq);
  SparsePass(kern, par, q, k, v, rows, counts, plan.stride, scale, plan.window, out);
  auto [b, e] = VisibleFor(q.pos0, plan.window, 0, k.rows);
  for (uint32_t h = 0; h < q.hq; ++h) {
    uint64_t seen = 0;
    for (int32_t j = 0; j < counts[h]; ++j) {
      const int32_t t = rows[static_cast<size_t>(h) * plan.stride + j];
      if (t >= static_cast<int32_t>(b) && t < static_cast<int32_t>(e)) ++seen;
    }
    r->support[h] = seen;
    r->rows_attended += seen;
    if (seen < e - b) r->exact = false;
  }
  r->omitted_mass_bound = r->exact ? 0 : 1;  // nothing scored the rows left out
  if (plan.audit && !r->exact) {
    *log_left = LogLeftOutExact(kern, par, q, k, v, scale, plan.window, b, e, plan.rows,
                                plan.counts, plan.stride);
  }
}

// SHARED sparse-auto: every head's block scores become the highest score of the query heads
// mapped to its K/V head (ties then break alike, so the group chooses one set of blocks).
void GroupMaxScores(const Queries& q, uint32_t groups, uint32_t nb, std::vector<float>* sel) {
  std::vector<float> best(static_cast<size_t>(groups) * nb,
                          -std::numeric_limits<float>::infinity());
  for (uint32_t h = 0; h < q.hq; ++h) {
    const float* in = sel->data() + static_cast<size_t>(h) * nb;
    float* g = best.data() + static_cast<size_t>(q.head_map[h]) * nb;
    for (uint32_t b = 0; b < nb; ++b) g[b] = std::max(g[b], in[b]);
  }
  for (uint32_t h = 0; h < q.hq; ++h) {
    const float* g = best.data() + static_cast<size_t>(q.head_map[h]) * nb;
    std::copy(g, g + nb, sel->data() + static_cast<size_t>(h) * nb);
  }
}

// Sparse-auto over the prefix (M = 1): block scores, top K_top blocks plus the first and last
// visible ones, then sparse attention over their rows.
// With plan.mass_bound, `ub` receives each head's Quest bound per block (for the receipt's
// omitted_mass_bound once the attended mass is known); with plan.audit, `log_left` the exact
// exp-mass each head left out.
void SparseAuto(const kernels::AttentionKernels& kern, const Parallel& par, const Plan& plan,
                const Tensor3& k, const Tensor3& v, float scale, const Partial& out, Receipt* r,
                std::vector<float>* ub, std::vector<double>* log_left) {
  const Queries& q = plan.q;
  const kernels::BlockSummaries& s = plan.summaries;
  const uint32_t nb = s.nblocks, B = s.block;
  auto [lo, hi] = VisibleFor(q.pos0, plan.window, 0, k.rows);
  std::vector<float> sel(static_cast<size_t>(q.hq) * nb), mean_scores;
  kern.ScoreBlocks(q, s, plan.selector, sel.data());
  if (plan.mass_bound) {
    if (plan.selector == kernels::BlockSelector::kQuest) {
      *ub = sel;  // each head's own bound, before SHARED ranks by the group's
    } else {
      ub->resize(sel.size());
      kern.ScoreBlocks(q, s, kernels::BlockSelector::kQuest, ub->data());
    }
  }
  if (plan.selector == kernels::BlockSelector::kMean) {
    mean_scores = sel;
  } else {
    mean_scores.resize(sel.size());
    kern.ScoreBlocks(q, s, kernels::BlockSelector::kMean, mean_scores.data());
  }
  if (plan.recent > 0 && lo < hi) {  // RECENT: the blocks before the last rank first
    const auto [from, to] = RecentBlocks(lo / B, (hi - 1) / B, plan.recent);
    for (uint32_t h = 0; h < q.hq; ++h) {
      float* hs = sel.data() + static_cast<size_t>(h) * nb;
      for (uint32_t b = from; b < to; ++b) hs[b] = std::numeric_limits<float>::infinity();
    }
  }
  if (plan.shared_blocks) GroupMaxScores(q, k.heads, nb, &sel);
  const uint32_t stride = std::min<uint64_t>(static_cast<uint64_t>(plan.k_top + 2) * B, k.rows);
  std::vector<int32_t> rows(static_cast<size_t>(q.hq) * stride);
  std::vector<int32_t> counts(q.hq, 0);
  r->blocks.assign(q.hq, {});
  double om = 0;
  if (lo < hi) {
    const uint32_t b_lo = lo / B, b_hi = (hi - 1) / B;
    r->blocks_total = b_hi - b_lo + 1;
    std::vector<uint32_t> cand;
    std::vector<uint8_t> chosen(nb);
    for (uint32_t h = 0; h < q.hq; ++h) {
      const float* hs = sel.data() + static_cast<size_t>(h) * nb;
      std::fill(chosen.begin(), chosen.end(), 0);
      chosen[b_lo] = chosen[b_hi] = 1;
      cand.clear();
      for (uint32_t b = b_lo + 1; b < b_hi; ++b) cand.push_back(b);
      const size_t keep = std::min<size_t>(plan.k_top, cand.size());
      std::partial_sort(cand.begin(), cand.begin() + keep, cand.end(), [&](uint32_t x, uint32_t y) {
        return hs[x] > hs[y] || (hs[x] == hs[y] && x < y);
      });
      for (size_t j = 0; j < keep; ++j) chosen[cand[j]] = 1;
      // The proxy weight of a block: its visible rows times exp(scale · q·mean).
      const float* ms = mean_scores.data() + static_cast<size_t>(h) * nb;
      float mx = -std::numeric_limits<float>::infinity();
      for (uint32_t b = b_lo; b <= b_hi; ++b) mx = std::max(mx, ms[b] * scale);
      double all = 0, left_out = 0;
      int32_t* out_rows = rows.data() + static_cast<size_t>(h) * stride;
      int32_t n = 0;
      for (uint32_t b = b_lo; b <= b_hi; ++b) {
        const uint32_t r0 = std::max(b * B, lo), r1 = std::min((b + 1) * B, hi);
        const double w = (r1 - r0) * std::exp(static_cast<double>(ms[b]) * scale - mx);
        all += w;
        if (!chosen[b]) {
          left_out += w;
          continue;
        }
        r->blocks[h].push_back(b);
        for (uint32_t t = r0; t < r1; ++t) out_rows[n++] = static_cast<int32_t>(t);
      }
      counts[h] = n;
      if (r->blocks[h].size() < r->blocks_total) r->exact = false;
      om += all > 0 ? left_out / all : 0;
      r->support[h] += n;
      r->rows_attended += n;
    }
  }
  r->omitted_mass_estimate = q.hq ? om / q.hq : 0;
  if (plan.audit && !r->exact) {
    *log_left = LogLeftOutExact(kern, par, q, k, v, scale, plan.window, lo, hi, rows.data(),
                                counts.data(), stride);
  }
  // SHARED: a group's heads have one list; the kernels read each listed key once for them.
  SparsePass(kern, par, q, k, v, rows, counts, stride, scale, plan.window, out, plan.shared_blocks);
}

}  // namespace

Status Run(const kernels::AttentionKernels& kern, const Parallel& par, Plan plan, const Tensor3& k,
           const Tensor3& v, float* out, float* lse, Receipt* r) {
  const auto t0 = std::chrono::steady_clock::now();
  Queries& q = plan.q;
  const float scale = plan.scale > 0 ? plan.scale : 1.0f / std::sqrt(static_cast<float>(q.d));
  const uint32_t n = k.rows;
  const uint32_t s_suf = plan.k_suffix.rows;
  const bool fused = plan.form == Form::kFused || plan.form == Form::kSparseAutoFused;
  if (fused) q.pos0 = static_cast<int64_t>(n) + s_suf - q.m;
  const size_t nrows = static_cast<size_t>(q.hq) * q.m;
  *r = Receipt{};
  r->support.assign(q.hq, 0);
  PartialBuf acc(nrows, q.d);
  Partial out_p = acc.View(q.d);

  // Prefix keys each query row may see (the support of an exact pass).
  std::vector<uint64_t> visible(nrows);
  std::vector<float> ub;         // sparse-auto with mass_bound: Quest's bound per head and block
  std::vector<double> log_left;  // AUDIT: the exact exp-mass each head left out (log)
  for (size_t row = 0; row < nrows; ++row) {
    visible[row] = VisibleCount(q.pos0 + static_cast<int64_t>(row % q.m), plan.window, n);
    r->visible_rows += visible[row];
  }
  switch (plan.form) {
    case Form::kDense:
    case Form::kFused:
      DensePass(kern, par, q, k, v, 0, scale, plan.window, out_p, r);
      r->rows_attended = r->visible_rows;
      for (size_t row = 0; row < nrows; ++row) r->support[row / q.m] += visible[row];
      break;
    case Form::kTopK:  // more than N keys per row is every key: no larger lists needed
      TopK(kern, par, q, k, v, std::min(plan.top_k, n), scale, plan.window, out_p, r);
      break;
    case Form::kSparse:
      CallerSparse(kern, par, plan, k, v, scale, out_p, r, &log_left);
      break;
    case Form::kSparseAuto:
    case Form::kSparseAutoFused:
      SparseAuto(kern, par, plan, k, v, scale, out_p, r, &ub, &log_left);
      break;
    case Form::kMla:
    case Form::kMlaSparse:
    case Form::kMlaFused:
      return Error("an MLA plan runs over latent rows (RunMla), not per-head K/V");
  }

  if (fused) {
    // The suffix: dense and causal, at positions N..N+S−1, merged into the prefix partial.
    PartialBuf suf(nrows, q.d);
    Partial suf_p = suf.View(q.d);
    Receipt ignored;
    DensePass(kern, par, q, plan.k_suffix, plan.v_suffix, n, scale, plan.window, suf_p, &ignored);
    kernels::MergePartial(out_p, suf_p);
    for (size_t row = 0; row < nrows; ++row) {
      const int64_t p = q.pos0 + static_cast<int64_t>(row % q.m);
      auto [b, e] = VisibleFor(p, plan.window, n, s_suf);
      r->rows_attended += e - b;
      r->visible_rows += e - b;
      r->support[row / q.m] += e - b;
    }
  }
  if (!ub.empty() && q.m == 1) {  // sparse-auto: each head's bound against all it attended
    auto [lo, hi] = VisibleFor(q.pos0, plan.window, 0, n);
    double sum = 0;
    for (uint32_t h = 0; h < q.hq; ++h) {
      const float row_lse = out_p.l[h] > 0 ? out_p.m[h] + std::log(out_p.l[h])
                                           : -std::numeric_limits<float>::infinity();
      sum += OmittedMassBound(ub.data() + static_cast<size_t>(h) * plan.summaries.nblocks,
                              r->blocks[h], plan.summaries.block, lo, hi, scale, row_lse);
    }
    r->omitted_mass_bound = q.hq ? sum / q.hq : 0;
  }
  if (!log_left.empty()) {  // M = 1: each head's exact share against all it attended
    double sum = 0;
    for (uint32_t h = 0; h < q.hq; ++h) {
      const float row_lse = out_p.l[h] > 0 ? out_p.m[h] + std::log(out_p.l[h])
                                           : -std::numeric_limits<float>::infinity();
      sum += ShareLeftOut(log_left[h], row_lse);
    }
    r->omitted_mass_exact = q.hq ? sum / q.hq : 0;
  }
  kernels::FinalizePartial(out_p, out, lse);
  r->micros =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  return Status::Ok();
}

double OmittedMassBound(const float* ub, const std::vector<uint32_t>& chosen, uint32_t block,
                        uint64_t lo, uint64_t hi, float scale, float lse) {
  if (lo >= hi || block == 0) return 0;
  const uint64_t b_lo = lo / block, b_hi = (hi - 1) / block;
  // log Σ rows_b · exp(scale · ub[b]) over the blocks left out, as a running log-sum-exp. The
  // kernels' scores may round above the float bound (a GPU kernel's half-precision query, the
  // dot product's order): a margin of 1e-3 of the exponent's size covers it.
  double mx = -std::numeric_limits<double>::infinity(), acc = 0;
  size_t c = 0;
  for (uint64_t b = b_lo; b <= b_hi; ++b) {
    while (c < chosen.size() && chosen[c] < b) ++c;
    if (c < chosen.size() && chosen[c] == b) continue;
    const uint64_t r0 = std::max(b * block, lo), r1 = std::min((b + 1) * block, hi);
    const double e = static_cast<double>(scale) * ub[b];
    const double t = std::log(static_cast<double>(r1 - r0)) + e + 1e-3 * (1 + std::abs(e));
    if (t > mx) {
      acc = acc * std::exp(mx - t) + 1;
      mx = t;
    } else {
      acc += std::exp(t - mx);
    }
  }
  if (acc == 0) return 0;
  return ShareLeftOut(mx + std::log(acc), lse);
}

std::pair<uint32_t, uint32_t> RecentBlocks(uint32_t b_lo, uint32_t b_hi, uint32_t recent) {
  if (recent == 0) return {0, 0};
  return {std::max(b_lo + 1, b_hi - std::min(b_hi, recent)), b_hi};
}

double LogSumExpLeftOut(const float* scores, const uint8_t* kept, size_t n) {
  double mx = -std::numeric_limits<double>::infinity();
  for (size_t t = 0; t < n; ++t) {
    if (!kept[t]) mx = std::max(mx, static_cast<double>(scores[t]));
  }
  if (mx == -std::numeric_limits<double>::infinity()) return mx;
  double sum = 0;
  for (size_t t = 0; t < n; ++t) {
    if (!kept[t]) sum += std::exp(static_cast<double>(scores[t]) - mx);
  }
  return mx + std::log(sum);
}

double ShareLeftOut(double log_left, float lse) {
  if (log_left == -std::numeric_limits<double>::infinity()) return 0;
  if (!std::isfinite(static_cast<double>(lse))) return 1;
  // left / (left + attended) in the log domain: a logistic of the difference.
  return 1 / (1 + std::exp(static_cast<double>(lse) - log_left));
}

}  // namespace pion::attention
