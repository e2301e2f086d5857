// Server-wide ATTEND.PREFIX counters for INFO attention and /metrics (any thread).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

#include "attention/cost_model.h"
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
  std::atomic<uint64_t> stores_from{0};     // ATTEND.PREFIX.STORE ... FROM <ns>
  std::atomic<uint64_t> promotions{0};      // queries that waited for their slot to come back
  std::atomic<uint64_t> misses{0};          // queries on a slot that does not exist
  std::atomic<uint64_t> gpu_upload_failures{0};  // STOREs refused at the GPU stage
  std::atomic<uint64_t> cpu_fallbacks{0};     // cuda queries computed on the CPU to meet a deadline
  std::atomic<uint64_t> approx_fallbacks{0};  // exact asks answered sparse under ALLOW APPROX
  // How long queries take here (admission against deadlines, the approximate fallback).
  CostModel cost;
};

}  // namespace pion::attention
