// CostModel: how long a query takes on this machine, from the executors' own measurements —
// what a request with a DEADLINE is admitted against, and what decides whether an approximate
// answer (ALLOW APPROX) would come sooner than the exact one.
//
// A query's work (WorkOf) is counted in units: the K/V bytes the kernels read (summaries, and
// the summaries' first build, included) plus their multiply-adds. Seconds = fixed + per_unit ·
// units, fitted per key — backend, form, K/V dtype, query rows per head (1, 2–16, 17+), and
// whether it runs inline on a shard thread or split across the compute pool — by exponentially
// weighted least squares over the queries that ran (newest weigh most), scaled to the low side
// of the recent samples (their 30th percentile against the fit: runs slowed by other work on
// the machine do not make a query look slower than it usually is). A key nothing has run
// under yet is measured on demand (CPU: CalibrateCpu runs the form on synthetic K/V of the
// key's shape and dtype, once) or borrows a measured neighbour's rate (same backend and form);
// with nothing comparable measured there is no estimate and nothing is refused on a guess.
// Thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attention/executor.h"
#include "kernels/attention.h"

namespace pion::attention {

// What a plan costs over a slot of `rows` keys, `heads` K/V heads of `dtype`.
struct Work {
  double bytes = 0;  // read by the kernels
  double macs = 0;   // multiply-adds (q·k and p·v, selection scores)
  double units() const { return bytes + macs; }
};
// `summarized`: the slot's summaries for plan.block are filled (sparse-auto builds them once,
// reading all of K, otherwise).
Work WorkOf(const Plan& plan, uint32_t rows, uint32_t heads, kernels::DType dtype, bool summarized);

struct CostKey {
  bool gpu = false;
  Form form = Form::kDense;
  kernels::DType dtype = kernels::DType::kF32;
  uint8_t rows_class = 0;   // query rows per head: 0 = 1, 1 = 2..16, 2 = 17+
  bool inline_run = false;  // on the shard thread (small queries), not split on the pool
  auto Tie() const {
    return std::make_tuple(gpu, static_cast<int>(form), static_cast<int>(dtype), rows_class,
                           inline_run);
  }
  bool operator<(const CostKey& o) const { return Tie() < o.Tie(); }
  bool operator==(const CostKey& o) const { return Tie() == o.Tie(); }
  std::string Name() const;  // "cpu dense fp16 m1 pool"
};
CostKey KeyOf(bool gpu, const Plan& plan, kernels::DType dtype, bool inline_run);

class CostModel {
 public:
  // Seconds the work takes once it starts, or nullopt when nothing comparable ran yet.
  std::optional<double> Estimate(const CostKey& key, const Work& w) const;
  // A finished computation: seconds from its start to its result (no queue wait).
  void Record(const CostKey& key, const Work& w, double seconds);
  // True when the key itself has measurements (not only a neighbour's).
  bool Measured(const CostKey& key) const;

  // Work admitted to the compute pool and not finished, in estimated seconds: a new job waits
  // behind it (Add when a job is queued, Sub when it finishes).
  void AddQueued(double seconds);
  void SubQueued(double seconds);
  double queued_seconds() const;

  struct Fit {
    CostKey key;
    double fixed_s = 0, per_unit_s = 0;
    double samples = 0;  // weight of the samples behind it (decayed)
  };
  std::vector<Fit> Fits() const;

 private:
  static constexpr size_t kRecent = 32;
  struct Stats {  // weighted sums of (x = units, y = seconds)
    double w = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
    uint64_t n = 0;
    // The last kRecent samples: how far the fit's shape sits from what really ran (the low
    // side of it: a run slowed by other work is the machine's noise, not the query's cost).
    std::array<std::pair<double, double>, kRecent> recent{};
  };
  static Fit FitOf(const CostKey& key, const Stats& s);
  // The fit scaled to the 30th percentile of the recent samples' seconds / fitted seconds.
  static double Scaled(const Fit& f, const Stats& s, double units);

  mutable std::mutex mu_;
  std::map<CostKey, Stats> stats_;
  double queued_ = 0;
};

// Measures the key on the CPU kernels: runs its form on synthetic K/V (`heads` K/V heads of the
// key's dtype, head dim d, hq query heads, m rows each) at two sizes, twice each, through
// `par`, and records them. A few milliseconds, once per key (when a deadline needs an estimate
// nothing has measured yet).
void CalibrateCpu(CostModel& model, const kernels::AttentionKernels& kern, const Parallel& par,
                  const CostKey& key, uint32_t hq, uint32_t heads, uint32_t d, uint32_t m);

// The approximate fallback of a dense decode step that would miss its deadline (ALLOW APPROX):
// the K_top of a sparse-auto pass (blocks of `block` rows, plus the first and the last, SHARED
// per K/V head group) that is estimated to finish within `seconds_left` and sooner than
// `dense_seconds`, both with a margin (the estimate must fit in 3/4 of the smaller: a large
// K_top extrapolates from what was measured); nullopt when none does (fewer than one block, or
// sparse would not be faster). `sparse` is the plan as it would run (form, block, shared set;
// k_top is chosen). It leaves out at least one block: never a K_top that chooses all of them.
std::optional<uint32_t> AffordableTopK(const CostModel& model, const CostKey& key, Plan sparse,
                                       uint32_t rows, uint32_t heads, kernels::DType dtype,
                                       bool summarized, double seconds_left, double dense_seconds);

}  // namespace pion::attention
