// The executor's algebra, on the CPU backend against the scalar reference: split-K equals one
// pass, the fused forms equal prefix and suffix merged, full-support sparse forms equal dense,
// and receipts count what was attended.
#include "attention/executor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

namespace pion::attention {
namespace {

using kernels::DType;
using kernels::Tensor3;

struct Data {
  uint32_t heads, rows, d;
  std::vector<float> k, v;
  Data(uint32_t h, uint32_t n, uint32_t d_, std::mt19937& rng) : heads(h), rows(n), d(d_) {
    std::normal_distribution<float> g;
    k.resize(size_t{h} * n * d_);
    v.resize(k.size());
    for (auto& x : k) x = g(rng);
    for (auto& x : v) x = g(rng);
  }
  Tensor3 K() const { return {k.data(), DType::kF32, heads, rows, d}; }
  Tensor3 V() const { return {v.data(), DType::kF32, heads, rows, d}; }
};

std::vector<float> Randn(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> g;
  std::vector<float> x(n);
  for (auto& e : x) e = g(rng);
  return x;
}

std::vector<int32_t> Contiguous(uint32_t hq, uint32_t heads) {
  std::vector<int32_t> m(hq);
  for (uint32_t h = 0; h < hq; ++h) m[h] = static_cast<int32_t>(h / (hq / heads));
  return m;
}

void ExpectNear(const std::vector<float>& a, const std::vector<float>& b, float tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_NEAR(a[i], b[i], tol * (1 + std::fabs(b[i]))) << "at " << i;
  }
}

// Runs a plan on `kern` and returns output (+ lse appended).
std::vector<float> RunPlan(const kernels::AttentionKernels& kern, const Plan& plan, const Data& kv,
                           int threads, Receipt* r, size_t out_rows) {
  std::vector<float> out(out_rows * plan.q.d + out_rows);
  Parallel par{threads, nullptr};
  Receipt local;
  EXPECT_TRUE(Run(kern, par, plan, kv.K(), kv.V(), out.data(), out.data() + out_rows * plan.q.d,
                  r ? r : &local)
                  .ok());
  return out;
}

TEST(Executor, SplitKEqualsOnePass) {
  std::mt19937 rng(1);
  Data kv(2, 5000, 64, rng);
  auto q = Randn(8 * 3 * 64, rng);
  auto map = Contiguous(8, 2);
  Plan p;
  p.q = {q.data(), 8, 3, 64, map.data(), 5000};
  Receipt r1, r4;
  auto one = RunPlan(kernels::CpuKernels(), p, kv, 1, &r1, 24);
  auto four = RunPlan(kernels::CpuKernels(), p, kv, 4, &r4, 24);
  auto ref = RunPlan(kernels::ReferenceKernels(), p, kv, 1, nullptr, 24);
  EXPECT_EQ(r1.splits, 1u);
  EXPECT_GT(r4.splits, 1u);
  ExpectNear(four, one, 2e-5f);
  ExpectNear(one, ref, 2e-5f);
  EXPECT_TRUE(r4.exact);
  EXPECT_EQ(r4.rows_attended, 24u * 5000);
}

TEST(Executor, WindowAndQposRestrictVisibleRows) {
  std::mt19937 rng(2);
  Data kv(1, 300, 32, rng);
  auto q = Randn(2 * 32, rng);
  auto map = Contiguous(1, 1);
  Plan p;
  p.q = {q.data(), 1, 2, 32, map.data(), 100};  // rows at positions 100 and 101
  p.window = 10;
  Receipt r;
  auto out = RunPlan(kernels::CpuKernels(), p, kv, 4, &r, 2);
  auto ref = RunPlan(kernels::ReferenceKernels(), p, kv, 1, nullptr, 2);
  ExpectNear(out, ref, 2e-5f);
  EXPECT_EQ(r.rows_attended, 20u);  // keys 91..100 and 92..101
  EXPECT_EQ(r.support[0], 20u);
}

TEST(Executor, FusedEqualsPrefixMergedWithSuffix) {
  std::mt19937 rng(3);
  const uint32_t H = 2, HQ = 4, N = 700, S = 9, M = 4, D = 96;
  Data kv(H, N, D, rng), suf(H, S, D, rng);
  auto q = Randn(size_t{HQ} * M * D, rng);
  std::vector<int32_t> map = {1, 0, 1, 0};  // not contiguous
  Plan fused;
  fused.form = Form::kFused;
  fused.q = {q.data(), HQ, M, D, map.data(), 0};
  fused.k_suffix = suf.K();
  fused.v_suffix = suf.V();
  Receipt r;
  auto got = RunPlan(kernels::CpuKernels(), fused, kv, 2, &r, HQ * M);

  // Prefix (queries at N+S-M..) and suffix separately, merged by the LSE formula.
  Plan pre;
  pre.q = fused.q;
  pre.q.pos0 = N + S - M;
  auto a = RunPlan(kernels::ReferenceKernels(), pre, kv, 1, nullptr, HQ * M);
  Plan sp = pre;
  sp.q.pos0 = S - M;  // the suffix alone, positions 0..S-1
  auto b = RunPlan(kernels::ReferenceKernels(), sp, suf, 1, nullptr, HQ * M);
  std::vector<float> want(size_t{HQ} * M * D);
  for (size_t row = 0; row < size_t{HQ} * M; ++row) {
    const float la = a[HQ * M * D + row], lb = b[HQ * M * D + row];
    const float m = std::max(la, lb);
    const double wa = std::exp(la - m), wb = std::exp(lb - m);
    for (uint32_t j = 0; j < D; ++j) {
      want[row * D + j] =
          static_cast<float>((wa * a[row * D + j] + wb * b[row * D + j]) / (wa + wb));
    }
  }
  got.resize(want.size());
  ExpectNear(got, want, 5e-5f);
  EXPECT_TRUE(r.exact);
  // Each query row sees the whole prefix plus the suffix up to itself.
  uint64_t expect = 0;
  for (uint32_t i = 0; i < M; ++i) expect += N + (S - M + i + 1);
  EXPECT_EQ(r.rows_attended, expect * HQ);
}

TEST(Executor, FullSupportSparseFormsEqualDense) {
  std::mt19937 rng(4);
  const uint32_t H = 2, HQ = 8, N = 1000, D = 128;
  Data kv(H, N, D, rng);
  auto q = Randn(size_t{HQ} * D, rng);
  auto map = Contiguous(HQ, H);
  Plan dense;
  dense.q = {q.data(), HQ, 1, D, map.data(), N};
  auto want = RunPlan(kernels::ReferenceKernels(), dense, kv, 1, nullptr, HQ);
  want.resize(size_t{HQ} * D);

  // Caller-sparse with every index (reversed order).
  std::vector<int32_t> rows(size_t{HQ} * N), counts(HQ, N);
  for (uint32_t h = 0; h < HQ; ++h)
    for (uint32_t t = 0; t < N; ++t) rows[h * N + t] = static_cast<int32_t>(N - 1 - t);
  Plan sparse = dense;
  sparse.form = Form::kSparse;
  sparse.rows = rows.data();
  sparse.counts = counts.data();
  sparse.stride = N;
  Receipt rs;
  auto got = RunPlan(kernels::CpuKernels(), sparse, kv, 2, &rs, HQ);
  got.resize(want.size());
  ExpectNear(got, want, 2e-5f);
  EXPECT_TRUE(rs.exact);
  EXPECT_EQ(rs.rows_attended, uint64_t{HQ} * N);

  // Sparse-auto with K_top >= blocks, both selectors.
  for (auto sel : {kernels::BlockSelector::kMean, kernels::BlockSelector::kQuest}) {
    const uint32_t B = 64, nb = (N + B - 1) / B;
    std::vector<float> mean(size_t{H} * nb * D), mn(mean.size()), mx(mean.size());
    kernels::BlockSummaries s{mean.data(), mn.data(), mx.data(), H, nb, B, D};
    kernels::CpuKernels().Summarize(kv.K(), s);
    Plan sa = dense;
    sa.form = Form::kSparseAuto;
    sa.block = B;
    sa.k_top = nb;
    sa.selector = sel;
    sa.summaries = s;
    Receipt r;
    auto got2 = RunPlan(kernels::CpuKernels(), sa, kv, 2, &r, HQ);
    got2.resize(want.size());
    ExpectNear(got2, want, 2e-5f);
    EXPECT_TRUE(r.exact);
    EXPECT_EQ(r.blocks_total, nb);
    EXPECT_EQ(r.omitted_mass_estimate, 0.0);

    // Fewer blocks: approximate, support = rows of the chosen blocks.
    sa.k_top = 3;
    auto got3 = RunPlan(kernels::CpuKernels(), sa, kv, 2, &r, HQ);
    EXPECT_FALSE(r.exact);
    for (uint32_t h = 0; h < HQ; ++h) {
      ASSERT_EQ(r.blocks[h].size(), 5u);  // 3 + first + last
      EXPECT_EQ(r.blocks[h].front(), 0u);
      EXPECT_EQ(r.blocks[h].back(), nb - 1);
      uint64_t rows_in = 0;
      for (uint32_t b : r.blocks[h]) rows_in += std::min(N, (b + 1) * B) - b * B;
      EXPECT_EQ(r.support[h], rows_in);
    }
    EXPECT_GT(r.omitted_mass_estimate, 0.0);
    EXPECT_LT(r.omitted_mass_estimate, 1.0);
  }
}

// The receipt's omitted_mass_bound is never below the true share of softmax mass left out —
// keys with needles (rows aligned with a head's query) at random depths, both selectors, per
// head and SHARED, with a window and with a fused suffix — and is informative where the
// chosen blocks hold the needles (the true share computed here in double from the scores).
TEST(Executor, OmittedMassBoundIsNeverBelowTheTrueShare) {
  std::mt19937 rng(21);
  const uint32_t H = 2, HQ = 4, N = 4096, D = 64, B = 32, nb = N / B, S = 8;
  Data kv(H, N, D, rng);
  auto q = Randn(size_t{HQ} * D, rng);
  auto map = Contiguous(HQ, H);
  std::uniform_int_distribution<uint32_t> row(B, N - B - 1);
  for (uint32_t h = 0; h < HQ; ++h) {  // three needles per query head, 3 q in its K/V head
    for (int j = 0; j < 3; ++j) {
      float* k = kv.k.data() + (size_t{static_cast<uint32_t>(map[h])} * N + row(rng)) * D;
      for (uint32_t x = 0; x < D; ++x) k[x] = 3 * q[size_t{h} * D + x];
    }
  }
  auto ks = Randn(size_t{H} * S * D, rng), vs = Randn(ks.size(), rng);
  std::vector<float> mean(size_t{H} * nb * D), mn(mean.size()), mx(mean.size());
  kernels::BlockSummaries s{mean.data(), mn.data(), mx.data(), H, nb, B, D};
  kernels::CpuKernels().Summarize(kv.K(), s);
  const double scale = 1 / std::sqrt(double{D});
  auto score = [&](const std::vector<float>& keys, uint32_t rows, uint32_t h, uint32_t t) {
    const float* k = keys.data() + (size_t{static_cast<uint32_t>(map[h])} * rows + t) * D;
    double dot = 0;
    for (uint32_t x = 0; x < D; ++x) dot += double{q[size_t{h} * D + x]} * k[x];
    return dot * scale;
  };
  int informative = 0;
  for (auto sel : {kernels::BlockSelector::kMean, kernels::BlockSelector::kQuest}) {
    for (bool shared : {false, true}) {
      for (int64_t window : {int64_t{0}, int64_t{1500}}) {
        for (bool fused : {false, true}) {
          for (uint32_t k_top : {2u, 8u, 32u}) {
            Plan p;
            p.form = fused ? Form::kSparseAutoFused : Form::kSparseAuto;
            p.q = {q.data(), HQ, 1, D, map.data(), N};
            p.window = window;
            p.block = B;
            p.k_top = k_top;
            p.selector = sel;
            p.shared_blocks = shared;
            p.summaries = s;
            p.mass_bound = true;
            p.audit = true;
            if (fused) {
              p.k_suffix = {ks.data(), DType::kF32, H, S, D};
              p.v_suffix = {vs.data(), DType::kF32, H, S, D};
            }
            Receipt r;
            RunPlan(kernels::CpuKernels(), p, kv, 2, &r, HQ);
            const int64_t pos = fused ? int64_t{N} + S - 1 : N;
            const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
            double true_share = 0;
            for (uint32_t h = 0; h < HQ; ++h) {
              std::vector<double> sc;
              std::vector<uint8_t> kept;
              for (int64_t t = lo; t < N; ++t) {
                sc.push_back(score(kv.k, N, h, static_cast<uint32_t>(t)));
                const uint32_t b = static_cast<uint32_t>(t / B);
                kept.push_back(std::binary_search(r.blocks[h].begin(), r.blocks[h].end(), b));
              }
              for (uint32_t t = 0; fused && t < S; ++t) {
                sc.push_back(score(ks, S, h, t));
                kept.push_back(1);
              }
              const double top = *std::max_element(sc.begin(), sc.end());
              double all = 0, left = 0;
              for (size_t i = 0; i < sc.size(); ++i) {
                all += std::exp(sc[i] - top);
                if (!kept[i]) left += std::exp(sc[i] - top);
              }
              true_share += left / all / HQ;
            }
            SCOPED_TRACE(testing::Message()
                         << "selector " << static_cast<int>(sel) << " shared " << shared
                         << " window " << window << " fused " << fused << " k_top " << k_top);
            EXPECT_FALSE(r.exact);
            EXPECT_GE(r.omitted_mass_bound, true_share);
            EXPECT_LE(r.omitted_mass_bound, 1.0);
            // AUDIT: the exact share, from every visible key's score.
            EXPECT_NEAR(r.omitted_mass_exact, true_share, 1e-5);
            informative += r.omitted_mass_bound < 0.5;
          }
        }
      }
    }
  }
  // Quest ranks the needles' blocks first: its bounds there are far below 1.
  EXPECT_GT(informative, 8);

  // Without mass_bound: not computed (0); other forms: top_k exact, caller rows 1, dense 0.
  Plan p;
  p.form = Form::kSparseAuto;
  p.q = {q.data(), HQ, 1, D, map.data(), N};
  p.block = B;
  p.k_top = 4;
  p.summaries = s;
  Receipt r;
  RunPlan(kernels::CpuKernels(), p, kv, 2, &r, HQ);
  EXPECT_EQ(r.omitted_mass_bound, 0.0);
  p.form = Form::kTopK;
  p.top_k = 64;
  RunPlan(kernels::CpuKernels(), p, kv, 2, &r, HQ);
  EXPECT_GT(r.omitted_mass_bound, 0.0);
  EXPECT_EQ(r.omitted_mass_bound, r.omitted_mass_estimate);
  std::vector<int32_t> rows(size_t{HQ} * 16, 5), counts(HQ, 1);
  p.form = Form::kSparse;
  p.rows = rows.data();
  p.counts = counts.data();
  p.stride = 16;
  p.audit = true;
  RunPlan(kernels::CpuKernels(), p, kv, 2, &r, HQ);
  EXPECT_EQ(r.omitted_mass_bound, 1.0);
  double caller_share = 0;  // each head attended row 5 only
  for (uint32_t h = 0; h < HQ; ++h) {
    double all = 0;
    for (uint32_t t = 0; t < N; ++t) all += std::exp(score(kv.k, N, h, t) - score(kv.k, N, h, 5));
    caller_share += (1 - 1 / all) / HQ;
  }
  EXPECT_NEAR(r.omitted_mass_exact, caller_share, 1e-5);
  p.form = Form::kDense;
  RunPlan(kernels::CpuKernels(), p, kv, 2, &r, HQ);
  EXPECT_EQ(r.omitted_mass_bound, 0.0);
}

// SHARED sparse-auto: a group's heads choose the same blocks (by their highest scores), and the
// result does not depend on how the query heads are split over threads (runs of whole groups
// with a contiguous map, of single heads otherwise).
TEST(Executor, SharedSparseAutoIsOneChoicePerGroup) {
  std::mt19937 rng(9);
  const uint32_t H = 4, HQ = 16, N = 3000, D = 64, B = 32, nb = (N + B - 1) / B;
  Data kv(H, N, D, rng);
  auto q = Randn(size_t{HQ} * D, rng);
  std::vector<float> mean(size_t{H} * nb * D), mn(mean.size()), mx(mean.size());
  kernels::BlockSummaries s{mean.data(), mn.data(), mx.data(), H, nb, B, D};
  kernels::CpuKernels().Summarize(kv.K(), s);
  for (bool contiguous : {true, false}) {
    auto map = Contiguous(HQ, H);
    if (!contiguous) std::shuffle(map.begin(), map.end(), rng);
    Plan sa;
    sa.q = {q.data(), HQ, 1, D, map.data(), N};
    sa.form = Form::kSparseAuto;
    sa.block = B;
    sa.k_top = 6;
    sa.selector = kernels::BlockSelector::kQuest;
    sa.summaries = s;
    sa.shared_blocks = true;
    Receipt r1;
    const auto one = RunPlan(kernels::CpuKernels(), sa, kv, 1, &r1, HQ);
    for (uint32_t h = 0; h < HQ; ++h) {
      for (uint32_t h2 = 0; h2 < HQ; ++h2) {
        if (map[h] == map[h2]) EXPECT_EQ(r1.blocks[h], r1.blocks[h2]) << h << " " << h2;
      }
    }
    Receipt ref_r;
    const auto want = RunPlan(kernels::ReferenceKernels(), sa, kv, 1, &ref_r, HQ);
    EXPECT_EQ(ref_r.blocks, r1.blocks);
    ExpectNear(one, want, 2e-5f);
    for (int threads : {3, 8, 16}) {
      Receipt r;
      ExpectNear(RunPlan(kernels::CpuKernels(), sa, kv, threads, &r, HQ), one, 1e-6f);
      EXPECT_EQ(r.blocks, r1.blocks);
    }
  }
}

TEST(Executor, TopKKeepsTheBestKeys) {
  std::mt19937 rng(5);
  const uint32_t N = 500, D = 64;
  Data kv(1, N, D, rng);
  auto q = Randn(2 * D, rng);
  auto map = Contiguous(2, 1);
  Plan p;
  p.form = Form::kTopK;
  p.q = {q.data(), 2, 1, D, map.data(), N};
  p.top_k = N;  // every key: exact
  Receipt r;
  auto all = RunPlan(kernels::CpuKernels(), p, kv, 2, &r, 2);
  EXPECT_TRUE(r.exact);
  Plan dense = p;
  dense.form = Form::kDense;
  auto want = RunPlan(kernels::ReferenceKernels(), dense, kv, 1, nullptr, 2);
  ExpectNear(all, want, 2e-5f);

  p.top_k = 1;  // one key per row: the output is that key's V row
  auto one = RunPlan(kernels::CpuKernels(), p, kv, 2, &r, 2);
  EXPECT_FALSE(r.exact);
  EXPECT_EQ(r.rows_attended, 2u);
  for (uint32_t h = 0; h < 2; ++h) {
    int best = 0;
    float bs = -1e30f;
    for (uint32_t t = 0; t < N; ++t) {
      float s = 0;
      for (uint32_t j = 0; j < D; ++j) s += q[h * D + j] * kv.k[t * D + j];
      if (s > bs) bs = s, best = static_cast<int>(t);
    }
    for (uint32_t j = 0; j < D; ++j) EXPECT_NEAR(one[h * D + j], kv.v[best * D + j], 1e-6f);
  }
}

TEST(Executor, SummariesSplitAcrossHeadsEqualOnePass) {
  std::mt19937 rng(21);
  const uint32_t H = 5, N = 300, D = 64, B = 32, nb = (N + B - 1) / B;
  Data kv(H, N, D, rng);
  // fp32 and fp8 (its row scales follow the elements: each head range takes its own).
  std::vector<uint8_t> fp8(kernels::TensorBytes(DType::kFP8, H, N, D));
  for (size_t i = 0; i < size_t{H} * N * D; ++i) fp8[i] = static_cast<uint8_t>(rng() % 0x7e);
  float* scales = reinterpret_cast<float*>(fp8.data() + size_t{H} * N * D);
  for (size_t i = 0; i < size_t{H} * N; ++i) scales[i] = 0.01f * (1 + i % 7);
  for (const Tensor3 k : {kv.K(), kernels::MakeTensor(fp8.data(), DType::kFP8, H, N, D)}) {
    std::vector<float> a(size_t{H} * nb * D * 3), b(a.size());
    const size_t n = size_t{H} * nb * D;
    kernels::BlockSummaries one{a.data(), a.data() + n, a.data() + 2 * n, H, nb, B, D};
    kernels::BlockSummaries split{b.data(), b.data() + n, b.data() + 2 * n, H, nb, B, D};
    kernels::CpuKernels().Summarize(k, one);
    Parallel par{3, [](size_t m, const std::function<void(size_t)>& fn) {
                   for (size_t i = m; i-- > 0;) fn(i);  // out of order, as threads take them
                 }};
    Summarize(kernels::CpuKernels(), par, k, split);
    EXPECT_EQ(a, b);
  }
}

// ---- MLA (RunMla) ------------------------------------------------------------------------------

struct LatentData {
  uint32_t rows, dk, dv;
  std::vector<float> c;
  LatentData(uint32_t n, uint32_t dk_, uint32_t dv_, std::mt19937& rng)
      : rows(n), dk(dk_), dv(dv_), c(Randn(size_t{n} * dk_, rng)) {}
  kernels::Latent View() const {
    return {reinterpret_cast<const uint8_t*>(c.data()), kernels::LatentType::kF32, rows, dk, dv};
  }
};

std::vector<float> RunMlaPlan(const kernels::AttentionKernels& kern, const Plan& plan,
                              const kernels::Latent& c, int threads, Receipt* r) {
  const size_t n = size_t{plan.q.hq} * plan.q.m;
  std::vector<float> out(n * plan.dv + n);
  Receipt local;
  EXPECT_TRUE(RunMla(kern, Parallel{threads, nullptr}, plan, c, out.data(),
                     out.data() + n * plan.dv, r ? r : &local)
                  .ok());
  return out;
}

Plan MlaPlan(Form form, const std::vector<float>& q, uint32_t hq, uint32_t m, const LatentData& c,
             int64_t pos0) {
  Plan p;
  p.form = form;
  p.q = {q.data(), hq, m, c.dk, nullptr, pos0};
  p.dv = c.dv;
  p.scale = 0.06f;
  return p;
}

TEST(ExecutorMla, SplitEqualsOnePassAndReference) {
  std::mt19937 rng(52);
  LatentData c(3000, 192, 128, rng);
  auto q = Randn(size_t{16} * 2 * 192, rng);
  Plan p = MlaPlan(Form::kMla, q, 16, 2, c, 2998);  // MTP: the last two rows causal
  Receipt r1, r4;
  auto one = RunMlaPlan(kernels::CpuKernels(), p, c.View(), 1, &r1);
  auto four = RunMlaPlan(kernels::CpuKernels(), p, c.View(), 4, &r4);
  auto ref = RunMlaPlan(kernels::ReferenceKernels(), p, c.View(), 1, nullptr);
  EXPECT_EQ(r1.splits, 1u);
  EXPECT_GT(r4.splits, 1u);
  ExpectNear(four, one, 2e-5f);
  ExpectNear(one, ref, 2e-5f);
  EXPECT_TRUE(r4.exact);
  EXPECT_EQ(r4.visible_rows, uint64_t{16} * (2999 + 3000));
  EXPECT_EQ(r4.rows_attended, r4.visible_rows);
  EXPECT_EQ(r4.support[5], 2999u + 3000u);
}

TEST(ExecutorMla, FusedEqualsPrefixAndSuffixMerged) {
  std::mt19937 rng(53);
  LatentData prefix(900, 80, 64, rng), suffix(5, 80, 64, rng);
  auto q = Randn(size_t{8} * 3 * 80, rng);
  Plan fused = MlaPlan(Form::kMlaFused, q, 8, 3, prefix, 0);
  fused.latent_suffix = suffix.View();
  Receipt r;
  auto got = RunMlaPlan(kernels::CpuKernels(), fused, prefix.View(), 2, &r);
  // The same thing as one latent set: the prefix rows then the suffix rows, queries at the last 3.
  LatentData all(905, 80, 64, rng);
  std::copy(prefix.c.begin(), prefix.c.end(), all.c.begin());
  std::copy(suffix.c.begin(), suffix.c.end(), all.c.begin() + prefix.c.size());
  auto want = RunMlaPlan(kernels::ReferenceKernels(), MlaPlan(Form::kMla, q, 8, 3, all, 902),
                         all.View(), 1, nullptr);
  ExpectNear(got, want, 2e-5f);
  EXPECT_EQ(r.rows_attended, uint64_t{8} * (903 + 904 + 905));
}

TEST(ExecutorMla, SparseListsPerTokenAndTheirReceipt) {
  std::mt19937 rng(54);
  LatentData c(400, 80, 64, rng);
  auto q = Randn(size_t{4} * 2 * 80, rng);
  // Token 0 (position 398) lists rows 0..199 and 399 (not visible to it); token 1 lists all 400.
  std::vector<int32_t> rows(2 * 400), counts = {201, 400};
  for (int i = 0; i < 200; ++i) rows[i] = i;
  rows[200] = 399;
  for (int i = 0; i < 400; ++i) rows[400 + i] = 399 - i;
  Plan p = MlaPlan(Form::kMlaSparse, q, 4, 2, c, 398);
  p.rows = rows.data();
  p.counts = counts.data();
  p.stride = 400;
  Receipt r;
  auto got = RunMlaPlan(kernels::CpuKernels(), p, c.View(), 3, &r);
  kernels::LatentKeys keys;  // the reference's own reading of the lists
  keys.c = c.View();
  keys.rows = rows.data();
  keys.counts = counts.data();
  keys.stride = 400;
  std::vector<float> m(8), l(8), o(8 * 64), want(8 * 64 + 8);
  kernels::ReferenceKernels().AttendLatent({q.data(), 4, 2, 398}, keys, 0.06f, 0,
                                           {m.data(), l.data(), o.data(), 8, 64});
  kernels::FinalizePartial({m.data(), l.data(), o.data(), 8, 64}, want.data(), want.data() + 512);
  ExpectNear(got, want, 2e-5f);
  EXPECT_FALSE(r.exact);  // token 0 sees 399 rows and listed 200 of them
  EXPECT_EQ(r.rows_attended, uint64_t{4} * (200 + 400));
  EXPECT_EQ(r.support[0], 600u);
  // Full lists are exact.
  counts[0] = 0;
  for (int i = 0; i < 399; ++i) rows[i] = i;
  counts[0] = 399;
  EXPECT_TRUE((RunMlaPlan(kernels::CpuKernels(), p, c.View(), 2, &r), r.exact));
}

}  // namespace
}  // namespace pion::attention
