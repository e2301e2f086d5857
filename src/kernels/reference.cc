// The scalar reference backend: the obvious loops with double accumulation, written for
// checking rather than speed. Every other backend is tested against it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/attention.h"
#include "kernels/fp16.h"

namespace pion::kernels {
namespace {

double Element(const Tensor3& t, uint32_t head, uint32_t row, uint32_t j) {
  const uint8_t* p = t.Row(head, row);
  if (t.dtype == DType::kF16) return internal::LoadF16(p + 2 * j);
  if (t.dtype == DType::kBF16) return internal::LoadBF16(p + 2 * j);
  if (t.dtype == DType::kFP8) return internal::LoadFp8(p + j, t.Scale(head, row));
  float f;
  std::memcpy(&f, p + 4 * j, sizeof(f));
  return f;
}

// Element j of latent row t, from its stored layout (attention.h, LatentType).
double LatentElement(const Latent& c, uint32_t t, uint32_t j) {
  const uint8_t* p = c.Row(t);
  float scale;
  switch (c.type) {
    case LatentType::kF16:
      return internal::LoadF16(p + 2 * j);
    case LatentType::kBF16:
      return internal::LoadBF16(p + 2 * j);
    case LatentType::kFP8:
      std::memcpy(&scale, p, 4);
      return internal::LoadFp8(p + 4 + j, scale);
    case LatentType::kFP8DsMla:
      if (j >= c.dv) return internal::LoadBF16(p + c.dv + 4 * (c.dv / 128) + 2 * (j - c.dv));
      std::memcpy(&scale, p + c.dv + 4 * (j / 128), 4);
      return internal::LoadFp8(p + j, scale);
    default:
      float f;
      std::memcpy(&f, p + 4 * j, sizeof(f));
      return f;
  }
}

bool Visible(int64_t query_pos, int64_t key_pos, int64_t window) {
  return key_pos <= query_pos && (window <= 0 || key_pos > query_pos - window);
}

double Dot(const float* q, const Tensor3& k, uint32_t head, uint32_t row) {
  double s = 0.0;
  for (uint32_t j = 0; j < k.d; ++j) s += static_cast<double>(q[j]) * Element(k, head, row, j);
  return s;
}

// The key rows query row r = h*m + i may attend, before masking.
std::vector<uint32_t> Candidates(const Keys& keys, size_t r) {
  std::vector<uint32_t> rows;
  if (keys.rows == nullptr) {
    for (uint32_t t = keys.begin; t < keys.end; ++t) rows.push_back(t);
  } else {
    const int32_t* list = keys.rows + r * keys.stride;
    for (int32_t c = 0; c < keys.counts[r]; ++c) rows.push_back(static_cast<uint32_t>(list[c]));
  }
  return rows;
}

class ReferenceBackend final : public AttentionKernels {
 public:
  std::string_view name() const override { return "reference"; }

  void Attend(const Queries& q, const Keys& keys, float scale, int64_t window,
              const Partial& out) const override {
    const uint32_t d = q.d;
    std::vector<double> s;
    std::vector<uint32_t> vis;
    std::vector<double> acc(d);
    for (uint32_t h = 0; h < q.hq; ++h) {
      const uint32_t g = static_cast<uint32_t>(q.head_map[h]);
      for (uint32_t i = 0; i < q.m; ++i) {
        const size_t r = static_cast<size_t>(h) * q.m + i;
        const float* qrow = q.q + r * d;
        const int64_t qpos = q.pos0 + i;
        s.clear();
        vis.clear();
        for (uint32_t t : Candidates(keys, r)) {
          if (!Visible(qpos, keys.pos0 + t, window)) continue;
          vis.push_back(t);
          s.push_back(static_cast<double>(scale) * Dot(qrow, keys.k, g, t));
        }
        float* o = out.o + r * d;
        if (vis.empty()) {
          out.m[r] = -std::numeric_limits<float>::infinity();
          out.l[r] = 0.0f;
          std::fill(o, o + d, 0.0f);
          continue;
        }
        // The state is stored relative to the float-rounded maximum, so (m, l, o) agree exactly.
        const float m = static_cast<float>(*std::max_element(s.begin(), s.end()));
        double l = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (size_t c = 0; c < vis.size(); ++c) {
          const double p = std::exp(s[c] - m);
          l += p;
          for (uint32_t j = 0; j < d; ++j) acc[j] += p * Element(keys.v, g, vis[c], j);
        }
        out.m[r] = m;
        out.l[r] = static_cast<float>(l);
        for (uint32_t j = 0; j < d; ++j) o[j] = static_cast<float>(acc[j]);
      }
    }
  }

  void Scores(const Queries& q, const Keys& keys, float scale, int64_t window,
              float* out) const override {
    const uint32_t n = keys.end - keys.begin;
    for (uint32_t h = 0; h < q.hq; ++h) {
      const uint32_t g = static_cast<uint32_t>(q.head_map[h]);
      for (uint32_t i = 0; i < q.m; ++i) {
        const size_t r = static_cast<size_t>(h) * q.m + i;
        for (uint32_t t = keys.begin; t < keys.end; ++t) {
          out[r * n + (t - keys.begin)] =
              Visible(q.pos0 + i, keys.pos0 + t, window)
                  ? static_cast<float>(scale * Dot(q.q + r * q.d, keys.k, g, t))
                  : -std::numeric_limits<float>::infinity();
        }
      }
    }
  }

  void Summarize(const Tensor3& k, const BlockSummaries& out) const override {
    for (uint32_t h = 0; h < out.heads; ++h) {
      for (uint32_t b = 0; b < out.nblocks; ++b) {
        const uint32_t first = b * out.block;
        const uint32_t last = std::min<uint32_t>(first + out.block, k.rows);
        const size_t base = (static_cast<size_t>(h) * out.nblocks + b) * out.d;
        for (uint32_t j = 0; j < out.d; ++j) {
          double sum = 0.0;
          double lo = std::numeric_limits<double>::infinity();
          double hi = -std::numeric_limits<double>::infinity();
          for (uint32_t t = first; t < last; ++t) {
            const double x = Element(k, h, t, j);
            sum += x;
            lo = std::min(lo, x);
            hi = std::max(hi, x);
          }
          const uint32_t count = last > first ? last - first : 0;
          out.mean[base + j] = count != 0 ? static_cast<float>(sum / count) : 0.0f;
          out.min[base + j] = count != 0 ? static_cast<float>(lo) : 0.0f;
          out.max[base + j] = count != 0 ? static_cast<float>(hi) : 0.0f;
        }
      }
    }
  }

  void ScoreBlocks(const Queries& q, const BlockSummaries& s, BlockSelector selector,
                   float* out) const override {
    for (uint32_t h = 0; h < q.hq; ++h) {
      const uint32_t g = static_cast<uint32_t>(q.head_map[h]);
      const float* qrow = q.q + static_cast<size_t>(h) * q.m * q.d;
      for (uint32_t b = 0; b < s.nblocks; ++b) {
        const size_t base = (static_cast<size_t>(g) * s.nblocks + b) * s.d;
        double score = 0.0;
        for (uint32_t j = 0; j < s.d; ++j) {
          const double x = qrow[j];
          if (selector == BlockSelector::kMean) {
            score += x * s.mean[base + j];
          } else {
            score += std::max(x * s.min[base + j], x * s.max[base + j]);
          }
        }
        out[static_cast<size_t>(h) * s.nblocks + b] = static_cast<float>(score);
      }
    }
  }

  void AttendLatent(const LatentQueries& q, const LatentKeys& keys, float scale, int64_t window,
                    const Partial& out) const override {
    const uint32_t dk = keys.c.dk, dv = keys.c.dv;
    std::vector<double> s, acc(dv);
    std::vector<uint32_t> vis;
    for (uint32_t h = 0; h < q.hq; ++h) {
      for (uint32_t i = 0; i < q.m; ++i) {
        const size_t r = static_cast<size_t>(h) * q.m + i;
        const float* qrow = q.q + r * dk;
        const int64_t qpos = q.pos0 + i;
        std::vector<uint32_t> cand;
        if (keys.rows == nullptr) {
          for (uint32_t t = keys.begin; t < keys.end; ++t) cand.push_back(t);
        } else {
          for (int32_t c = 0; c < keys.counts[i]; ++c) {
            cand.push_back(
                static_cast<uint32_t>(keys.rows[static_cast<size_t>(i) * keys.stride + c]));
          }
        }
        s.clear();
        vis.clear();
        for (uint32_t t : cand) {
          if (!Visible(qpos, keys.pos0 + t, window)) continue;
          double dot = 0.0;
          for (uint32_t j = 0; j < dk; ++j)
            dot += static_cast<double>(qrow[j]) * LatentElement(keys.c, t, j);
          vis.push_back(t);
          s.push_back(static_cast<double>(scale) * dot);
        }
        float* o = out.o + r * dv;
        if (vis.empty()) {
          out.m[r] = -std::numeric_limits<float>::infinity();
          out.l[r] = 0.0f;
          std::fill(o, o + dv, 0.0f);
          continue;
        }
        const float m = static_cast<float>(*std::max_element(s.begin(), s.end()));
        double l = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (size_t c = 0; c < vis.size(); ++c) {
          const double p = std::exp(s[c] - m);
          l += p;
          for (uint32_t j = 0; j < dv; ++j) acc[j] += p * LatentElement(keys.c, vis[c], j);
        }
        out.m[r] = m;
        out.l[r] = static_cast<float>(l);
        for (uint32_t j = 0; j < dv; ++j) o[j] = static_cast<float>(acc[j]);
      }
    }
  }
};

}  // namespace

const AttentionKernels& ReferenceKernels() {
  static const ReferenceBackend backend;
  return backend;
}

}  // namespace pion::kernels
