// The cost model: the work it counts per form, its fit of fixed cost and rate from samples, the
// neighbour it borrows from, the on-demand CPU measurement, and the approximate fallback's
// K_top choice.
#include "attention/cost_model.h"

#include <gtest/gtest.h>

#include <cmath>

namespace pion::attention {
namespace {

using kernels::DType;

Plan Decode(uint32_t hq, uint32_t d) {
  Plan p;
  p.form = Form::kDense;
  p.q.hq = hq;
  p.q.m = 1;
  p.q.d = d;
  return p;
}

TEST(CostModel, WorkCountsBytesReadAndMultiplyAdds) {
  const Plan p = Decode(32, 128);
  const Work f32 = WorkOf(p, 1024, 8, DType::kF32, true);
  const Work f16 = WorkOf(p, 1024, 8, DType::kF16, true);
  EXPECT_DOUBLE_EQ(f32.bytes, 2.0 * 8 * 1024 * 128 * 4);  // K and V once
  EXPECT_DOUBLE_EQ(f16.bytes, f32.bytes / 2);
  EXPECT_DOUBLE_EQ(f32.macs, 2.0 * 32 * 1024 * 128);       // q·k and p·v per query head
  const Work fp8 = WorkOf(p, 1024, 8, DType::kFP8, true);  // the row scales too
  EXPECT_DOUBLE_EQ(fp8.bytes, 2.0 * 8 * 1024 * (128 + 4));
  // Sparse-auto: a 1/8 budget reads about an eighth; SHARED reads a group's rows once; the
  // first query also builds the summaries from all of K.
  Plan s = p;
  s.form = Form::kSparseAuto;
  s.block = 64;
  s.k_top = 2;
  s.shared_blocks = true;
  const Work shared = WorkOf(s, 2048, 8, DType::kF32, true);
  s.shared_blocks = false;
  const Work apart = WorkOf(s, 2048, 8, DType::kF32, true);
  EXPECT_LT(shared.bytes, apart.bytes);
  EXPECT_LT(shared.units(), WorkOf(p, 2048, 8, DType::kF32, true).units() / 4);
  EXPECT_GT(WorkOf(s, 2048, 8, DType::kF32, false).bytes, apart.bytes + 8.0 * 2048 * 128 * 4 - 1);
}

TEST(CostModel, FitsFixedCostAndRateAndFollowsTheNewest) {
  CostModel m;
  const CostKey key = KeyOf(false, Decode(32, 128), DType::kF16, false);
  EXPECT_FALSE(m.Estimate(key, Work{1e6, 0}).has_value());  // nothing measured: no guess
  for (int i = 0; i < 10; ++i) {
    const double units = 1e6 * (1 + i % 4);
    m.Record(key, Work{units, 0}, 50e-6 + units * 1e-9);  // 50 µs + 1 ns per unit
  }
  ASSERT_TRUE(m.Measured(key));
  EXPECT_NEAR(*m.Estimate(key, Work{8e6, 0}), 50e-6 + 8e-3, 1e-6);
  // The machine slows down: the newest samples take over.
  for (int i = 0; i < 60; ++i) {
    const double units = 1e6 * (1 + i % 4);
    m.Record(key, Work{units, 0}, 50e-6 + units * 2e-9);
  }
  EXPECT_NEAR(*m.Estimate(key, Work{8e6, 0}), 50e-6 + 16e-3, 2e-4);
}

TEST(CostModel, RunsSlowedByOtherWorkDoNotInflateTheEstimate) {
  CostModel m;
  const CostKey key = KeyOf(false, Decode(32, 128), DType::kF32, false);
  for (int i = 0; i < 40; ++i) {
    const double units = 1e6 * (1 + i % 3);
    const bool slowed = i % 4 == 0;  // a quarter of the runs shared the cores: twice as long
    m.Record(key, Work{units, 0}, units * 1e-9 * (slowed ? 2.0 : 1.0));
  }
  // The query itself takes 1 ns a unit: the estimate stays near it, not near the mean (1.25).
  EXPECT_NEAR(*m.Estimate(key, Work{4e6, 0}), 4e-3, 0.3e-3);
}

TEST(CostModel, OneSizeGivesARateThroughTheOrigin) {
  CostModel m;
  const CostKey key = KeyOf(false, Decode(32, 128), DType::kF32, false);
  for (int i = 0; i < 5; ++i) m.Record(key, Work{4e6, 0}, 2e-3);
  EXPECT_NEAR(*m.Estimate(key, Work{8e6, 0}), 4e-3, 1e-9);
}

TEST(CostModel, BorrowsTheNearestNeighboursRateOfTheSameForm) {
  CostModel m;
  const Plan p = Decode(32, 128);
  m.Record(KeyOf(false, p, DType::kF32, false), Work{1e6, 0}, 1e-3);
  // Another dtype of the same form and backend: its rate per unit.
  EXPECT_NEAR(*m.Estimate(KeyOf(false, p, DType::kF16, false), Work{2e6, 0}), 2e-3, 1e-9);
  // Not another backend, nor another way of running.
  EXPECT_FALSE(m.Estimate(KeyOf(true, p, DType::kF32, false), Work{1e6, 0}).has_value());
  EXPECT_FALSE(m.Estimate(KeyOf(false, p, DType::kF32, true), Work{1e6, 0}).has_value());
}

TEST(CostModel, CalibratesACpuKeyOnItsKernels) {
  CostModel m;
  Plan p = Decode(8, 64);
  const CostKey key = KeyOf(false, p, DType::kBF16, true);
  CalibrateCpu(m, kernels::CpuKernels(), Parallel{}, key, 8, 2, 64, 1);
  ASSERT_TRUE(m.Measured(key));
  const double small = *m.Estimate(key, WorkOf(p, 1024, 2, DType::kBF16, true));
  const double large = *m.Estimate(key, WorkOf(p, 8192, 2, DType::kBF16, true));
  EXPECT_GT(small, 0);
  EXPECT_GT(large, small);
  p.form = Form::kSparseAuto;
  const CostKey sparse = KeyOf(false, p, DType::kBF16, false);
  CalibrateCpu(m, kernels::CpuKernels(), Parallel{}, sparse, 8, 2, 64, 1);
  EXPECT_TRUE(m.Measured(sparse));
}

TEST(CostModel, ApproximateFallbackOnlyWhenSparseIsFasterAndInTime) {
  CostModel m;
  Plan s = Decode(32, 128);
  s.form = Form::kSparseAuto;
  s.block = 64;
  s.shared_blocks = true;
  const CostKey key = KeyOf(false, s, DType::kF32, false);
  m.Record(key, Work{1e6, 0}, 1e-3);  // 1 ns per unit, through the origin
  const uint32_t rows = 32768;
  // Time for about half the blocks: K_top whose estimate fits in 3/4 of that (the margin).
  s.k_top = 256;
  const double half = *m.Estimate(key, WorkOf(s, rows, 8, DType::kF32, true));
  auto k = AffordableTopK(m, key, s, rows, 8, DType::kF32, true, half, 1.0);
  ASSERT_TRUE(k.has_value());
  EXPECT_LT(*k, 256);
  s.k_top = *k;
  EXPECT_LE(*m.Estimate(key, WorkOf(s, rows, 8, DType::kF32, true)), 0.75 * half);
  s.k_top = *k + 1;
  EXPECT_GT(*m.Estimate(key, WorkOf(s, rows, 8, DType::kF32, true)), 0.75 * half);
  // Sparse no faster than the exact answer: no fallback, however much time is left.
  EXPECT_FALSE(AffordableTopK(m, key, s, rows, 8, DType::kF32, true, 10.0, 1e-6).has_value());
  // Not even one block in time: none.
  EXPECT_FALSE(AffordableTopK(m, key, s, rows, 8, DType::kF32, true, 1e-9, 1.0).has_value());
  // Time for every block (an estimate that contradicts the dense one): still one block left
  // out, so the answer is approximate as its receipt says, never all blocks under another name.
  k = AffordableTopK(m, key, s, rows, 8, DType::kF32, true, 1e3, 1e3);
  ASSERT_TRUE(k.has_value());
  EXPECT_EQ(*k, rows / 64 - 3);
  // Too few blocks to leave one out besides the first and the last: none.
  EXPECT_FALSE(AffordableTopK(m, key, s, 192, 8, DType::kF32, true, 1e3, 1e3).has_value());
}

}  // namespace
}  // namespace pion::attention
