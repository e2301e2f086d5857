// Server-wide ATTEND.PREFIX counters for INFO attention and /metrics (any thread).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

#include "attention/executor.h"

namespace pion::attention {

struct Counters {
  std::array<std::atomic<uint64_t>, kFormCount> queries{};  // by Form
  std::atomic<uint64_t> exact{0};        // queries whose output is exact attention
  std::atomic<uint64_t> approximate{0};  // queries restricted to a subset of the visible keys
  std::atomic<uint64_t> rows_attended{0};
  std::atomic<uint64_t> compute_us{0};      // kernel + selection time
  std::atomic<uint64_t> inline_queries{0};  // small host-memory queries run on the shard thread
  std::atomic<uint64_t> stores{0};          // ATTEND.PREFIX.STORE with blobs
  std::atomic<uint64_t> promotions{0};      // ATTEND.PREFIX.STORE ... FROM <ns>
  std::atomic<uint64_t> misses{0};          // queries on a slot that does not exist
  std::atomic<uint64_t> gpu_upload_failures{0};  // STOREs refused at the GPU stage
  std::atomic<uint64_t> cpu_fallbacks{0};     // cuda queries computed on the CPU to meet a deadline
  std::atomic<uint64_t> approx_fallbacks{0};  // exact asks answered sparse under ALLOW APPROX
  // Measured seconds per multiply-add of attention (query rows x keys x D), CPU and GPU: what
  // a query with a deadline is admitted against (EWMA of completed queries).
  std::atomic<double> seconds_per_mac[2] = {2e-10, 2e-13};
  void RecordRate(bool gpu, uint64_t macs, double seconds) {
    if (macs < (1u << 20) || seconds <= 0) return;  // small ones are fixed costs
    const double sample = seconds / static_cast<double>(macs);
    std::atomic<double>& r = seconds_per_mac[gpu ? 1 : 0];
    double cur = r.load(std::memory_order_relaxed);
    while (!r.compare_exchange_weak(cur, cur + 0.2 * (sample - cur), std::memory_order_relaxed)) {
    }
  }
};

}  // namespace pion::attention
