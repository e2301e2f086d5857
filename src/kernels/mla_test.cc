// Tests of the MLA kernel (AttendLatent): the CPU backend against the scalar double-precision
// reference over every latent storage type, DeepSeek's shape (dk 576, dv 512) and small ones,
// 1 to 128 query heads, 1 to 4 query tokens (decode and MTP, causal among themselves when they
// sit inside the rows), windows, sub-ranges and sparse lists per token, on every SIMD target
// this machine supports; split + merge equals one call.
//
// Tolerances as kernels_test's: per element of the finalized output |out − ref| <= 2e-5 ·
// (1 + |ref|), |lse − ref| <= 1e-5 · (1 + |ref|) (fp32 accumulation over dk and over the rows,
// Highway's Exp against double); empty rows exactly (output 0, lse −inf). Both backends decode
// every storage type exactly, so the types share the bound.
#include <hwy/targets.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"

namespace pion::kernels {
namespace {

constexpr float kOutTol = 2e-5f;
constexpr float kLseTol = 1e-5f;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Nearest e4m3fn code of |v| (v <= 448), ties to the even code: from the format's definition.
uint8_t E4m3Code(double v) {
  int best = 0;
  double best_err = kInf;
  for (int c = 0; c < 127; ++c) {
    const int e = c >> 3, m = c & 7;
    const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    const double err = std::fabs(mag - v);
    if (err < best_err || (err == best_err && c % 2 == 0)) best = c, best_err = err;
  }
  return static_cast<uint8_t>(best);
}

// n values as e4m3 bytes with scale amax / 448 (returned).
float EncodeE4m3(const float* x, uint32_t n, uint8_t* q) {
  float amax = 0.0f;
  for (uint32_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float scale = amax / 448.0f;
  const float inv = scale != 0.0f ? 448.0f / amax : 0.0f;
  for (uint32_t j = 0; j < n; ++j) {
    q[j] = static_cast<uint8_t>((std::signbit(x[j]) ? 0x80 : 0) | E4m3Code(std::fabs(x[j] * inv)));
  }
  return scale;
}

uint16_t Bf16Bits(float f) { return static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16); }

// Random latent rows stored as `type` (attention.h's layouts). fp16 values are drawn as bit
// patterns (normals in about ±[2^-6, 2), and some zeros), bf16 as the top halves of fp32.
struct Latents {
  LatentType type;
  uint32_t rows, dk, dv;
  std::vector<uint8_t> bytes;

  Latents(LatentType t, uint32_t n, uint32_t dk_, uint32_t dv_, std::mt19937& rng)
      : type(t), rows(n), dk(dk_), dv(dv_) {
    const size_t rb = LatentRowBytes(t, dk, dv);
    bytes.resize(rb * n);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> x(dk);
    for (uint32_t r = 0; r < n; ++r) {
      uint8_t* row = bytes.data() + r * rb;
      for (float& v : x) v = u(rng);
      if (r % 11 == 5) std::fill(x.begin(), x.end(), 0.0f);  // a zero row
      switch (t) {
        case LatentType::kF32:
          std::memcpy(row, x.data(), rb);
          break;
        case LatentType::kBF16:
          for (uint32_t j = 0; j < dk; ++j) {
            const uint16_t b = Bf16Bits(x[j]);
            std::memcpy(row + 2 * j, &b, 2);
          }
          break;
        case LatentType::kF16:
          for (uint32_t j = 0; j < dk; ++j) {
            const uint32_t bits = rng();
            uint16_t h = static_cast<uint16_t>((bits & 0x8000u) | ((9 + bits % 7) << 10) |
                                               ((bits >> 16) & 0x3FFu));
            if (r % 11 == 5 || bits % 97 == 0) h = 0;
            std::memcpy(row + 2 * j, &h, 2);
          }
          break;
        case LatentType::kFP8: {
          const float scale = EncodeE4m3(x.data(), dk, row + 4);
          std::memcpy(row, &scale, 4);
          break;
        }
        case LatentType::kFP8DsMla:
          for (uint32_t g = 0; g < dv / 128; ++g) {
            const float scale = EncodeE4m3(x.data() + 128 * g, 128, row + 128 * g);
            std::memcpy(row + dv + 4 * g, &scale, 4);
          }
          for (uint32_t j = dv; j < dk; ++j) {
            const uint16_t b = Bf16Bits(x[j] * 4.0f);  // RoPE values at another scale
            std::memcpy(row + dv + 4 * (dv / 128) + 2 * (j - dv), &b, 2);
          }
          break;
      }
    }
  }

  Latent View() const { return {bytes.data(), type, rows, dk, dv}; }
};

struct Problem {
  uint32_t hq, m;
  Latents c;
  std::vector<float> q;
  std::vector<int32_t> rows, counts;
  LatentQueries queries;
  LatentKeys keys;

  Problem(LatentType t, uint32_t hq_, uint32_t m_, uint32_t n, uint32_t dk, uint32_t dv,
          std::mt19937& rng)
      : hq(hq_), m(m_), c(t, n, dk, dv, rng), q(static_cast<size_t>(hq_) * m_ * dk) {
    std::uniform_real_distribution<float> u(-1.5f, 1.5f);
    for (float& x : q) x = u(rng);
    queries = {q.data(), hq, m, static_cast<int64_t>(n)};
    keys.c = c.View();
    keys.begin = 0;
    keys.end = n;
  }

  // Random distinct lists per query token; one token may get none.
  void MakeSparse(std::mt19937& rng, uint32_t max_count) {
    const uint32_t n = c.rows, stride = std::min(max_count, n);
    rows.assign(static_cast<size_t>(m) * stride, -1);
    counts.assign(m, 0);
    std::vector<int32_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    for (uint32_t i = 0; i < m; ++i) {
      std::shuffle(all.begin(), all.end(), rng);
      const uint32_t k = i == 2 ? 0 : std::uniform_int_distribution<uint32_t>(1, stride)(rng);
      std::copy(all.begin(), all.begin() + k, rows.begin() + size_t{i} * stride);
      counts[i] = static_cast<int32_t>(k);
    }
    keys.rows = rows.data();
    keys.counts = counts.data();
    keys.stride = stride;
  }
};

struct Result {
  std::vector<float> out, lse;
};

Result AttendOnce(const AttentionKernels& k, const Problem& p, float scale, int64_t window) {
  const size_t n = size_t{p.hq} * p.m;
  const uint32_t dv = p.c.dv;
  std::vector<float> m(n, std::nanf("")), l(n, std::nanf("")), o(n * dv, std::nanf(""));
  const Partial part{m.data(), l.data(), o.data(), n, dv};
  k.AttendLatent(p.queries, p.keys, scale, window, part);
  Result r;
  r.out.resize(n * dv);
  r.lse.resize(n);
  FinalizePartial(part, r.out.data(), r.lse.data());
  return r;
}

void ExpectClose(const Result& got, const Result& want, uint32_t dv, const std::string& what) {
  for (size_t r = 0; r < want.lse.size(); ++r) {
    if (std::isinf(want.lse[r])) {
      ASSERT_EQ(got.lse[r], -kInf) << what << " row " << r << " should be empty";
      for (uint32_t j = 0; j < dv; ++j) ASSERT_EQ(got.out[r * dv + j], 0.0f) << what;
      continue;
    }
    ASSERT_LE(std::fabs(got.lse[r] - want.lse[r]), kLseTol * (1 + std::fabs(want.lse[r])))
        << what << " row " << r << " lse " << got.lse[r] << " vs " << want.lse[r];
    for (uint32_t j = 0; j < dv; ++j) {
      const float g = got.out[r * dv + j], w = want.out[r * dv + j];
      ASSERT_LE(std::fabs(g - w), kOutTol * (1 + std::fabs(w)))
          << what << " row " << r << " col " << j << ": " << g << " vs " << w;
    }
  }
}

template <class Body>
void ForEachTarget(Body body) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    body(std::string(hwy::TargetName(target)));
  }
  hwy::SetSupportedTargetsForTest(0);
}

struct Shape {
  uint32_t dk, dv;
};
constexpr Shape kShapes[] = {{576, 512}, {192, 128}, {80, 64}, {64, 64}};
constexpr LatentType kTypes[] = {LatentType::kF32, LatentType::kF16, LatentType::kBF16,
                                 LatentType::kFP8, LatentType::kFP8DsMla};

bool Fits(LatentType t, Shape s) {
  return t != LatentType::kFP8DsMla || (s.dv % 128 == 0 && s.dk - s.dv == 64);
}

TEST(Mla, DenseMatchesReference) {
  std::mt19937 rng(5252);
  const uint32_t kHq[] = {1, 3, 16, 128};
  const uint32_t kM[] = {1, 2, 4, 3};
  const uint32_t kN[] = {1, 33, 200, 700};
  int cases = 0;
  for (Shape s : kShapes) {
    for (LatentType t : kTypes) {
      if (!Fits(t, s)) continue;
      for (int trial = 0; trial < 4; ++trial) {
        const uint32_t hq = kHq[(trial + static_cast<int>(t)) % 4], m = kM[trial];
        uint32_t n = kN[(trial + s.dk / 64) % 4];
        // Keep the double-precision reference cheap.
        while (n > 40 && uint64_t{hq} * m * n * s.dk > 20'000'000) n /= 2;
        Problem p(t, hq, m, n, s.dk, s.dv, rng);
        const int64_t windows[] = {0, 0, 7, static_cast<int64_t>(n) + 3};
        const int64_t window = windows[trial];
        p.keys.pos0 = 50;
        // Decode after the rows, or MTP tokens among the last rows (causal among themselves).
        p.queries.pos0 = trial % 2 == 0 ? 50 + n : 50 + n - m;
        if (trial == 3 && n > 4) {  // a sub-range, as one piece of a split
          p.keys.begin = n / 4;
          p.keys.end = n - n / 5;
        }
        const float scale = 1.0f / std::sqrt(192.0f);
        const std::string what = std::string(LatentTypeName(t)) + " dk=" + std::to_string(s.dk) +
                                 " dv=" + std::to_string(s.dv) + " hq=" + std::to_string(hq) +
                                 " m=" + std::to_string(m) + " n=" + std::to_string(n) +
                                 " w=" + std::to_string(window);
        const Result want = AttendOnce(ReferenceKernels(), p, scale, window);
        ForEachTarget([&](const std::string& target) {
          ExpectClose(AttendOnce(CpuKernels(), p, scale, window), want, s.dv, what + " " + target);
        });
        ++cases;
      }
    }
  }
  std::printf("[ info ] %d MLA dense cases on every target\n", cases);
}

TEST(Mla, SparseMatchesReference) {
  std::mt19937 rng(3052);
  for (Shape s : {kShapes[0], kShapes[2]}) {
    for (LatentType t : kTypes) {
      if (!Fits(t, s)) continue;
      for (uint32_t m : {1u, 4u}) {
        const uint32_t n = 300, hq = s.dk > 256 ? 16 : 40;
        Problem p(t, hq, m, n, s.dk, s.dv, rng);
        p.MakeSparse(rng, 70);
        p.queries.pos0 = n - m + 1 - m % 2;  // some listed rows lie after some tokens
        const float scale = 0.07f;
        const std::string what = std::string(LatentTypeName(t)) +
                                 " sparse dk=" + std::to_string(s.dk) + " m=" + std::to_string(m);
        const Result want = AttendOnce(ReferenceKernels(), p, scale, 0);
        ForEachTarget([&](const std::string& target) {
          ExpectClose(AttendOnce(CpuKernels(), p, scale, 0), want, s.dv, what + " " + target);
        });
      }
    }
  }
}

TEST(Mla, DeepSeekDecodeShapeLongContext) {
  std::mt19937 rng(61);
  for (LatentType t : {LatentType::kBF16, LatentType::kFP8DsMla}) {
    Problem p(t, 128, 1, 2100, 576, 512, rng);
    const Result want = AttendOnce(ReferenceKernels(), p, 0.1352f, 0);
    ExpectClose(AttendOnce(CpuKernels(), p, 0.1352f, 0), want, 512,
                std::string("hq 128 ") + std::string(LatentTypeName(t)));
  }
}

TEST(Mla, SplitAndMergeEqualsWhole) {
  std::mt19937 rng(8);
  Problem p(LatentType::kFP8DsMla, 32, 2, 500, 576, 512, rng);
  const size_t n = 64;
  const Result whole = AttendOnce(CpuKernels(), p, 0.1f, 0);
  std::vector<float> m(n), l(n), o(n * 512), m2(n), l2(n), o2(n * 512);
  const Partial a{m.data(), l.data(), o.data(), n, 512}, b{m2.data(), l2.data(), o2.data(), n, 512};
  LatentKeys first = p.keys, second = p.keys;
  first.end = 211;
  second.begin = 211;
  CpuKernels().AttendLatent(p.queries, first, 0.1f, 0, a);
  CpuKernels().AttendLatent(p.queries, second, 0.1f, 0, b);
  MergePartial(a, b);
  Result merged;
  merged.out.resize(n * 512);
  merged.lse.resize(n);
  FinalizePartial(a, merged.out.data(), merged.lse.data());
  ExpectClose(merged, whole, 512, "split at 211");
}

TEST(Mla, QueriesBeforeEveryRowAreEmpty) {
  std::mt19937 rng(9);
  Problem p(LatentType::kBF16, 4, 2, 40, 192, 128, rng);
  p.keys.pos0 = 100;
  p.queries.pos0 = 99;  // token 0 sees nothing, token 1 sees row 0
  const Result got = AttendOnce(CpuKernels(), p, 0.2f, 0);
  const Result want = AttendOnce(ReferenceKernels(), p, 0.2f, 0);
  ExpectClose(got, want, 128, "before the rows");
  EXPECT_EQ(got.lse[0], -kInf);
  EXPECT_NE(got.lse[1], -kInf);
}

TEST(Mla, LatentRowBytes) {
  EXPECT_EQ(LatentRowBytes(LatentType::kFP8DsMla, 576, 512), 656u);
  EXPECT_EQ(LatentRowBytes(LatentType::kBF16, 576, 512), 1152u);
  EXPECT_EQ(LatentRowBytes(LatentType::kFP8, 576, 512), 580u);
  EXPECT_EQ(LatentRowBytes(LatentType::kF32, 576, 512), 2304u);
  EXPECT_EQ(LatentTypeName(LatentType::kFP8DsMla), "fp8_ds_mla");
}

}  // namespace
}  // namespace pion::kernels
