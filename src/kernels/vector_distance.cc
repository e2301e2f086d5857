// Highway compiles this file once per x86 target (foreach_target); the functions return the
// best target's entry point, so a graph search calls it directly (no dispatch per distance).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/vector_distance.cc"
#include <hwy/foreach_target.h>  // must precede highway.h; re-includes this file per target
#include <hwy/highway.h>
//
#include <cstddef>

#include "kernels/cpu_simd-inl.h"
#include "kernels/vector_distance.h"

HWY_BEFORE_NAMESPACE();
namespace pion::kernels::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

float L2Squared(const void* av, const void* bv, const void* dim) {
  const float* HWY_RESTRICT a = static_cast<const float*>(av);
  const float* HWY_RESTRICT b = static_cast<const float*>(bv);
  const size_t n = *static_cast<const size_t*>(dim);
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF s0 = hn::Zero(df), s1 = hn::Zero(df), s2 = hn::Zero(df), s3 = hn::Zero(df);
  size_t j = 0;
  for (; j + 4 * lanes <= n; j += 4 * lanes) {
    const VF d0 = hn::Sub(hn::LoadU(df, a + j), hn::LoadU(df, b + j));
    const VF d1 = hn::Sub(hn::LoadU(df, a + j + lanes), hn::LoadU(df, b + j + lanes));
    const VF d2 = hn::Sub(hn::LoadU(df, a + j + 2 * lanes), hn::LoadU(df, b + j + 2 * lanes));
    const VF d3 = hn::Sub(hn::LoadU(df, a + j + 3 * lanes), hn::LoadU(df, b + j + 3 * lanes));
    s0 = hn::MulAdd(d0, d0, s0);
    s1 = hn::MulAdd(d1, d1, s1);
    s2 = hn::MulAdd(d2, d2, s2);
    s3 = hn::MulAdd(d3, d3, s3);
  }
  for (; j + lanes <= n; j += lanes) {
    const VF d0 = hn::Sub(hn::LoadU(df, a + j), hn::LoadU(df, b + j));
    s0 = hn::MulAdd(d0, d0, s0);
  }
  float tail = 0.0f;
  for (; j < n; ++j) tail += (a[j] - b[j]) * (a[j] - b[j]);
  return hn::GetLane(hn::SumOfLanes(df, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3)))) + tail;
}

float DotProduct(const void* av, const void* bv, const void* dim) {
  return Dot(static_cast<const float*>(av), static_cast<const float*>(bv),
             *static_cast<const size_t*>(dim));
}

float InnerProduct(const void* av, const void* bv, const void* dim) {
  return 1.0f - DotProduct(av, bv, dim);
}

}  // namespace HWY_NAMESPACE
}  // namespace pion::kernels::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pion::kernels {
namespace cpu {

HWY_EXPORT(L2Squared);
HWY_EXPORT(InnerProduct);
HWY_EXPORT(DotProduct);

// The entry of the target chosen for this CPU (the table's first entry chooses on each call).
VectorDistanceFn ChosenL2Squared() {
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
  return &HWY_DYNAMIC_DISPATCH(L2Squared);
}

VectorDistanceFn ChosenInnerProduct() {
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
  return &HWY_DYNAMIC_DISPATCH(InnerProduct);
}

VectorDistanceFn ChosenDotProduct() {
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
  return &HWY_DYNAMIC_DISPATCH(DotProduct);
}

}  // namespace cpu

VectorDistanceFn L2SquaredDistance() { return cpu::ChosenL2Squared(); }
VectorDistanceFn InnerProductDistance() { return cpu::ChosenInnerProduct(); }
VectorDistanceFn DotProduct() { return cpu::ChosenDotProduct(); }

}  // namespace pion::kernels
#endif  // HWY_ONCE
