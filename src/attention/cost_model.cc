#include "attention/cost_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

namespace pion::attention {
namespace {

using kernels::DType;

// Each new sample counts this much more than the one before it (the fit follows the machine as
// its load changes, over the last few dozen queries of a key).
constexpr double kDecay = 0.9;

uint8_t RowsClass(uint32_t m) { return m <= 1 ? 0 : m <= 16 ? 1 : 2; }

// Bytes of `rows` rows of `heads` heads of K or V (fp8: with the row scales).
double TensorRowsBytes(DType t, double heads, double rows, double d) {
  return heads * rows *
         (d * static_cast<double>(kernels::DTypeSize(t)) + (t == DType::kFP8 ? 4 : 0));
}

}  // namespace

Work WorkOf(const Plan& plan, uint32_t rows, uint32_t heads, DType dtype, bool summarized) {
  const double n = rows, h = heads, d = plan.q.d, hq = plan.q.hq, m = plan.q.m;
  const double s = plan.k_suffix.rows;
  Work w;
  auto dense = [&](double keys) {
    w.bytes += 2 * TensorRowsBytes(dtype, h, keys, d);
    w.macs += 2 * hq * m * keys * d;
  };
  auto suffix = [&] {
    w.bytes += 2 * h * s * d * 4;
    w.macs += 2 * hq * m * s * d;
  };
  switch (plan.form) {
    case Form::kDense:
      dense(n);
      break;
    case Form::kFused:
      dense(n);
      suffix();
      break;
    case Form::kTopK:  // every score, then softmax over the top k
      w.bytes += TensorRowsBytes(dtype, h, n, d) + TensorRowsBytes(dtype, hq, plan.top_k, d);
      w.macs += hq * m * n * (d + 1) + hq * m * plan.top_k * d;
      break;
    case Form::kSparse: {
      double listed = 0;
      for (uint32_t i = 0; i < plan.q.hq && plan.counts != nullptr; ++i) listed += plan.counts[i];
      w.bytes += 2 * TensorRowsBytes(dtype, 1, listed, d);
      w.macs += 2 * listed * d;
      break;
    }
    case Form::kSparseAuto:
    case Form::kSparseAutoFused: {
      const double b = std::max<uint32_t>(plan.block, 1);
      const double nblocks = std::ceil(n / b);
      const bool quest = plan.selector == kernels::BlockSelector::kQuest;
      if (!summarized) {  // mean, min and max of every block, from all of K
        w.bytes += TensorRowsBytes(dtype, h, n, d);
        w.macs += 3 * h * n * d;
      }
      w.bytes += h * nblocks * d * 4 * (quest ? 3 : 1);
      w.macs += hq * nblocks * d * (quest ? 3 : 1) + hq * nblocks;  // scores, then the ranking
      const double per_head = std::min(n, (static_cast<double>(plan.k_top) + 2) * b);
      w.bytes += 2 * TensorRowsBytes(dtype, plan.shared_blocks ? h : hq, per_head, d);
      w.macs += 2 * hq * per_head * d;
      if (plan.form == Form::kSparseAutoFused) suffix();
      break;
    }
    case Form::kMla:
    case Form::kMlaFused:
    case Form::kMlaSparse: {  // every head over one latent row set: d = dk, values dv
      const double dv = plan.dv;
      double keys = n;
      if (plan.form == Form::kMlaSparse) {
        keys = 0;
        for (uint32_t i = 0; i < plan.q.m && plan.counts != nullptr; ++i) keys += plan.counts[i];
        keys /= std::max(m, 1.0);
      }
      w.bytes += TensorRowsBytes(dtype, 1, keys * (plan.form == Form::kMlaSparse ? m : 1), d);
      w.macs += hq * m * keys * (d + dv);
      if (plan.form == Form::kMlaFused) {
        const double s_mla = plan.latent_suffix.rows;
        w.bytes += s_mla * d * 4;
        w.macs += hq * m * s_mla * (d + dv);
      }
      break;
    }
  }
  return w;
}

std::string CostKey::Name() const {
  static const char* kRows[] = {"m1", "m2-16", "m17+"};
  return std::string(gpu ? "gpu " : "cpu ") + std::string(FormName(form)) + " " +
         std::string(kernels::DTypeName(dtype)) + " " + kRows[std::min<int>(rows_class, 2)] +
         (inline_run ? " inline" : " pool");
}

CostKey KeyOf(bool gpu, const Plan& plan, DType dtype, bool inline_run) {
  CostKey k;
  k.gpu = gpu;
  k.form = plan.form;
  k.dtype = dtype;
  k.rows_class = RowsClass(plan.q.m);
  k.inline_run = inline_run;
  return k;
}

CostModel::Fit CostModel::FitOf(const CostKey& key, const Stats& s) {
  Fit f;
  f.key = key;
  f.samples = s.w;
  if (s.w <= 0 || s.sx <= 0) return f;
  const double mx = s.sx / s.w, my = s.sy / s.w;
  const double var = s.sxx / s.w - mx * mx, cov = s.sxy / s.w - mx * my;
  // Sizes that vary too little to separate a fixed cost from a rate: a rate through the origin.
  if (s.n >= 3 && var > 0.01 * mx * mx) {
    const double slope = cov / var, fixed = my - slope * mx;
    if (slope > 0 && fixed >= 0) {
      f.per_unit_s = slope;
      f.fixed_s = fixed;
      return f;
    }
  }
  f.per_unit_s = s.sxy > 0 && s.sxx > 0 ? s.sxy / s.sxx : my / mx;
  return f;
}

double CostModel::Scaled(const Fit& f, const Stats& s, double units) {
  const double shape = f.fixed_s + f.per_unit_s * units;
  const size_t n = std::min<uint64_t>(s.n, kRecent);
  if (n < 5) return shape;
  std::array<double, kRecent> ratio{};
  size_t m = 0;
  for (size_t i = 0; i < n; ++i) {
    const double fitted = f.fixed_s + f.per_unit_s * s.recent[i].first;
    if (fitted > 0) ratio[m++] = s.recent[i].second / fitted;
  }
  if (m == 0) return shape;
  const size_t k = m * 3 / 10;
  std::nth_element(ratio.begin(), ratio.begin() + k, ratio.begin() + m);
  return shape * ratio[k];
}

std::optional<double> CostModel::Estimate(const CostKey& key, const Work& w) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = stats_.find(key);
  if (it != stats_.end() && it->second.w > 0) {
    return Scaled(FitOf(key, it->second), it->second, w.units());
  }
  // A neighbour: the same backend, form and way of running, the nearest dtype / row class
  // measured (its rate per unit; units already count the dtype's bytes).
  const Stats* best = nullptr;
  int best_distance = 1 << 30;
  for (const auto& [k, s] : stats_) {
    if (k.gpu != key.gpu || k.form != key.form || k.inline_run != key.inline_run || s.w <= 0) {
      continue;
    }
    const int distance = 2 * std::abs(k.rows_class - key.rows_class) + (k.dtype != key.dtype);
    if (distance < best_distance) {
      best_distance = distance;
      best = &s;
    }
  }
  if (best == nullptr) return std::nullopt;
  return Scaled(FitOf(key, *best), *best, w.units());
}

void CostModel::Record(const CostKey& key, const Work& w, double seconds) {
  const double x = w.units();
  if (x <= 0 || !(seconds > 0)) return;
  std::lock_guard<std::mutex> lock(mu_);
  Stats& s = stats_[key];
  s.w = s.w * kDecay + 1;
  s.sx = s.sx * kDecay + x;
  s.sy = s.sy * kDecay + seconds;
  s.sxx = s.sxx * kDecay + x * x;
  s.sxy = s.sxy * kDecay + x * seconds;
  s.recent[s.n % kRecent] = {x, seconds};
  ++s.n;
}

bool CostModel::Measured(const CostKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = stats_.find(key);
  return it != stats_.end() && it->second.n > 0;
}

void CostModel::AddQueued(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  queued_ += seconds;
}

void CostModel::SubQueued(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  queued_ = std::max(0.0, queued_ - seconds);
}

double CostModel::queued_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_;
}

std::vector<CostModel::Fit> CostModel::Fits() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Fit> out;
  for (const auto& [k, s] : stats_) out.push_back(FitOf(k, s));
  return out;
}

void CalibrateCpu(CostModel& model, const kernels::AttentionKernels& kern, const Parallel& par,
                  const CostKey& key, uint32_t hq, uint32_t heads, uint32_t d, uint32_t m) {
  if (key.form == Form::kTopK || key.form == Form::kSparse) return;  // need the caller's lists
  // Two sizes, so the fit separates a fixed cost from a rate; the larger one past the caches
  // of most machines' cores for the usual head counts.
  for (const uint32_t rows : {uint32_t{1024}, uint32_t{4096}}) {
    const uint64_t bytes = kernels::TensorBytes(key.dtype, heads, rows, d);
    // Every byte written (an untouched page would read as the shared zero page, from cache):
    // 0x3c is a small finite value in every dtype (fp32, fp16, bf16, e4m3, and the fp8 scales).
    std::vector<uint8_t> kb(bytes, 0x3c), vb(bytes, 0x3c);
    std::vector<float> q(static_cast<size_t>(hq) * m * d, 0.01f), out(q.size()),
        lse(static_cast<size_t>(hq) * m);
    std::vector<int32_t> head_map(hq);
    for (uint32_t h = 0; h < hq; ++h)
      head_map[h] = static_cast<int32_t>(h / std::max(1u, hq / heads));
    const kernels::Tensor3 k = kernels::MakeTensor(kb.data(), key.dtype, heads, rows, d);
    const kernels::Tensor3 v = kernels::MakeTensor(vb.data(), key.dtype, heads, rows, d);
    Plan plan;
    plan.form = key.form;
    plan.q = {q.data(), hq, m, d, head_map.data(), rows};
    std::vector<float> ks, vs;
    if (plan.form == Form::kFused || plan.form == Form::kSparseAutoFused) {
      ks.assign(static_cast<size_t>(heads) * m * d, 0.01f);
      vs.assign(ks.size(), 0.01f);
      plan.k_suffix = {ks.data(), DType::kF32, heads, m, d};
      plan.v_suffix = {vs.data(), DType::kF32, heads, m, d};
    }
    std::vector<float> mean, mn, mx;
    bool summarized = false;
    if (plan.form == Form::kSparseAuto || plan.form == Form::kSparseAutoFused) {
      plan.block = 64;
      plan.k_top = rows == 1024 ? rows / 64 / 8 : rows / 64 / 2;  // budgets of 1/8 and 1/2
      plan.shared_blocks = true;
      const uint32_t nb = (rows + 63) / 64;
      mean.resize(static_cast<size_t>(heads) * nb * d);
      mn.resize(mean.size());
      mx.resize(mean.size());
      plan.summaries = {mean.data(), mn.data(), mx.data(), heads, nb, 64, d};
    }
    for (int rep = 0; rep < 2; ++rep) {
      const Work w = WorkOf(plan, rows, heads, key.dtype, summarized);
      const auto t0 = std::chrono::steady_clock::now();
      if (!summarized && plan.summaries.mean != nullptr) {
        Summarize(kern, par, k, plan.summaries);
      }
      Receipt r;
      const bool lse_out = plan.form != Form::kSparseAuto && plan.form != Form::kSparseAutoFused;
      Status s = Run(kern, par, plan, k, v, out.data(), lse_out ? lse.data() : nullptr, &r);
      const double took =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s.ok()) model.Record(key, w, took);
      summarized = true;
    }
  }
}

std::optional<uint32_t> AffordableTopK(const CostModel& model, const CostKey& key, Plan sparse,
                                       uint32_t rows, uint32_t heads, DType dtype, bool summarized,
                                       double seconds_left, double dense_seconds) {
  const uint32_t b = std::max<uint32_t>(sparse.block, 1);
  const uint32_t nblocks = (rows + b - 1) / b;
  // The first and last blocks always count: a K_top of nblocks - 2 would choose every block, the
  // exact answer under another name (and an estimate that says dense would not fit contradicts
  // one that says every block would). The fallback leaves out at least one block.
  if (nblocks < 4) return std::nullopt;
  auto seconds = [&](uint32_t k_top) -> std::optional<double> {
    sparse.k_top = k_top;
    return model.Estimate(key, WorkOf(sparse, rows, heads, dtype, summarized));
  };
  // A K_top past the sizes the sparse key was measured at is an extrapolation (a gathered row
  // costs about twice a streamed one on the CPU, and more as the lists grow): the estimate
  // must fit with a margin.
  constexpr double kMargin = 0.75;
  const double budget = kMargin * std::min(seconds_left, dense_seconds);
  // The largest K_top that fits (the estimate grows with K_top): a binary search.
  uint32_t lo = 0, hi = nblocks - 3;
  const auto least = seconds(1);
  if (!least || *least > budget) return std::nullopt;
  lo = 1;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo + 1) / 2;
    const auto t = seconds(mid);
    if (t && *t <= budget) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace pion::attention
