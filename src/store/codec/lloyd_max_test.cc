// The turbo centroid tables (lloyd_max_tables.h, printed by lloyd_max.py) are Lloyd-Max
// quantizers of N(0,1): a stationary point of Lloyd's algorithm, checked here independently of
// the generator with the closed-form conditional mean of a normal variable.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "store/codec/lloyd_max_tables.h"

namespace pion::codec::internal {
namespace {

double Pdf(double x) { return std::isinf(x) ? 0.0 : std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI); }
double Cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

struct Table {
  int bits;
  const float* centroids;
  const float* boundaries;
  double mse;
  double literature_mse;  // Max (1960), Table I: 2 bits 0.1175, 3 bits 0.03454, 4 bits 0.009497
};

const Table kTables[] = {
    {2, kLloydMax2Centroids, kLloydMax2Boundaries, kLloydMax2Mse, 0.1175},
    {3, kLloydMax3Centroids, kLloydMax3Boundaries, kLloydMax3Mse, 0.03454},
    {4, kLloydMax4Centroids, kLloydMax4Boundaries, kLloydMax4Mse, 0.009497},
};

TEST(LloydMax, BoundariesAreMidpointsOfCentroids) {
  for (const Table& t : kTables) {
    const int levels = 1 << t.bits;
    for (int k = 0; k + 1 < levels; ++k) {
      const double mid = (double{t.centroids[k]} + t.centroids[k + 1]) / 2;
      // The generator rounds the midpoint of its double centroids to float, so it may sit one
      // float ulp from the midpoint of the float centroids.
      EXPECT_LE(std::fabs(t.boundaries[k] - mid), std::fabs(mid) * 0x1p-23 + 1e-30)
          << t.bits << " bits, boundary " << k;
    }
  }
}

TEST(LloydMax, CentroidsAreConditionalMeansOfTheirCells) {
  for (const Table& t : kTables) {
    const int levels = 1 << t.bits;
    for (int k = 0; k < levels; ++k) {
      // Cells from the exact (double) midpoints of the float centroids.
      const double lo = k == 0 ? -INFINITY : (double{t.centroids[k - 1]} + t.centroids[k]) / 2;
      const double hi =
          k == levels - 1 ? INFINITY : (double{t.centroids[k]} + t.centroids[k + 1]) / 2;
      const double mean = (Pdf(lo) - Pdf(hi)) / (Cdf(hi) - Cdf(lo));
      // Float storage costs ~1.2e-7 relative; a non-stationary table misses by far more (one
      // Lloyd step from the uniform-quantile start moves centroids by ~1e-2).
      EXPECT_NEAR(t.centroids[k], mean, 1e-6) << t.bits << " bits, centroid " << k;
    }
  }
}

TEST(LloydMax, SymmetricAndAscending) {
  for (const Table& t : kTables) {
    const int levels = 1 << t.bits;
    for (int k = 0; k < levels; ++k) {
      EXPECT_EQ(t.centroids[k], -t.centroids[levels - 1 - k]);
      if (k > 0) {
        EXPECT_LT(t.centroids[k - 1], t.centroids[k]);
      }
    }
    EXPECT_EQ(t.boundaries[levels / 2 - 1], 0.0f);
  }
}

TEST(LloydMax, MseMatchesTheLiterature) {
  for (const Table& t : kTables) {
    // Recompute E[(X - Q(X))^2] by numerical integration, not from the generator's formula.
    double mse = 0;
    const int levels = 1 << t.bits;
    const double step = 1e-4;
    for (double x = -12; x < 12; x += step) {
      const double xm = x + step / 2;
      int k = 0;
      while (k + 1 < levels && xm >= t.boundaries[k]) ++k;
      mse += (xm - t.centroids[k]) * (xm - t.centroids[k]) * Pdf(xm) * step;
    }
    EXPECT_NEAR(mse, t.mse, 1e-7) << t.bits << " bits";
    EXPECT_NEAR(mse, t.literature_mse, 1e-4) << t.bits << " bits";
  }
}

TEST(LloydMax, CheckedInHeaderIsTheGeneratorsOutput) {
  const char* python = "/usr/bin/python3";
  if (std::system((std::string(python) + " -c 'import math' 2>/dev/null").c_str()) != 0) {
    GTEST_SKIP() << python << " is not available";
  }
  const std::string dir = PION_CODEC_SOURCE_DIR;
  const std::string out = testing::TempDir() + "/lloyd_max_tables.h";
  const std::string cmd = std::string(python) + " " + dir + "/lloyd_max.py --cxx > " + out;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto slurp = [](const std::string& path) {
    std::ifstream f(path);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  };
  EXPECT_EQ(slurp(out), slurp(dir + "/lloyd_max_tables.h"))
      << "regenerate with: python3 src/store/codec/lloyd_max.py --cxx > "
         "src/store/codec/lloyd_max_tables.h";
}

}  // namespace
}  // namespace pion::codec::internal
