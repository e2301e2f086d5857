// The partial-state algebra of attention.h: clear, exact online-softmax merge, finalize.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/attention.h"

namespace pion::kernels {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF16:
      return "fp16";
    case DType::kBF16:
      return "bf16";
    case DType::kFP8:
      return "fp8";
    default:
      return "fp32";
  }
}

std::string_view LatentTypeName(LatentType t) {
  switch (t) {
    case LatentType::kF16:
      return "fp16";
    case LatentType::kBF16:
      return "bf16";
    case LatentType::kFP8:
      return "fp8";
    case LatentType::kFP8DsMla:
      return "fp8_ds_mla";
    default:
      return "fp32";
  }
}

bool ParseDType(std::string_view name, DType* out) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8}) {
    if (name == DTypeName(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

void ClearPartial(const Partial& p) {
  for (size_t r = 0; r < p.n; ++r) {
    p.m[r] = -std::numeric_limits<float>::infinity();
    p.l[r] = 0.0f;
  }
  if (p.n != 0) std::memset(p.o, 0, p.n * p.d * sizeof(float));
}

void MergePartial(const Partial& into, const Partial& from) {
  const uint32_t d = into.d;
  for (size_t r = 0; r < into.n; ++r) {
    const float m_from = from.m[r];
    // An empty side (m = -inf) contributes nothing; testing it first keeps exp(-inf - -inf) = NaN
    // out of the arithmetic.
    if (m_from == -std::numeric_limits<float>::infinity() || from.l[r] == 0.0f) continue;
    float* o = into.o + r * d;
    const float* o_from = from.o + r * d;
    const float m_into = into.m[r];
    if (m_into == -std::numeric_limits<float>::infinity() || into.l[r] == 0.0f) {
      into.m[r] = m_from;
      into.l[r] = from.l[r];
      std::memcpy(o, o_from, d * sizeof(float));
      continue;
    }
    const float m = std::max(m_into, m_from);
    const float a = std::exp(m_into - m);
    const float b = std::exp(m_from - m);
    into.m[r] = m;
    into.l[r] = a * into.l[r] + b * from.l[r];
    for (uint32_t j = 0; j < d; ++j) o[j] = a * o[j] + b * o_from[j];
  }
}

void FinalizePartial(const Partial& p, float* out, float* lse) {
  const uint32_t d = p.d;
  for (size_t r = 0; r < p.n; ++r) {
    const float m = p.m[r];
    const float l = p.l[r];
    float* dst = out + r * d;
    if (m == -std::numeric_limits<float>::infinity() || !(l > 0.0f)) {
      std::memset(dst, 0, d * sizeof(float));
      if (lse != nullptr) lse[r] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const float inv = 1.0f / l;
    const float* o = p.o + r * d;
    for (uint32_t j = 0; j < d; ++j) dst[j] = o[j] * inv;
    if (lse != nullptr) lse[r] = m + std::log(l);
  }
}

}  // namespace pion::kernels
