// MemoryAccountant: --maxmemory admission with per-family accounting.
//
// Every family charges the bytes it stores to its own counter. A write first Reserve()s its
// size; if the total would pass maxmemory, the owning family's reclaimer is asked to make room
// (eviction/demotion of its own objects on the calling shard) and the reservation is retried
// once; if it still does not fit the write gets -OOM naming what was asked and what is free.
// Counters are atomics: shards charge concurrently without a lock.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <string_view>

#include "common/byte_budget.h"
#include "common/status.h"

namespace pion::server {

enum class MemFamily : int {
  kState,      // STATE.* fixed slots
  kSsm,        // SSM.PREFIX.* recurrent state blobs
  kVStore,     // V.* sessions (KV.PREFIX.* K/V)
  kAttention,  // ATTEND.PREFIX.* resident K/V
  kIndex,      // ATTEND.* HNSW index and KV.* entries
  kCount
};
std::string_view MemFamilyName(MemFamily f);

class MemoryAccountant {
 public:
  // Tries to free at least `bytes`: of the family's own memory when `family_only` (its cap
  // binds), of any family's otherwise (--maxmemory binds). Returns the bytes actually released.
  using Reclaimer = std::function<uint64_t(uint64_t bytes, bool family_only)>;

  void set_maxmemory(uint64_t bytes) { max_.store(bytes, std::memory_order_relaxed); }
  uint64_t maxmemory() const { return max_.load(std::memory_order_relaxed); }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t used(MemFamily f) const {
    return by_family_[static_cast<int>(f)].load(std::memory_order_relaxed);
  }
  uint64_t free_bytes() const;
  // Bytes family f may still reserve now: the lesser of what maxmemory and its cap leave.
  uint64_t Headroom(MemFamily f) const;

  // A cap on one family's bytes on top of maxmemory (e.g. --attention-memory); 0 = none.
  void set_family_limit(MemFamily f, uint64_t bytes) {
    limits_[static_cast<int>(f)].store(bytes, std::memory_order_relaxed);
  }
  uint64_t family_limit(MemFamily f) const {
    return limits_[static_cast<int>(f)].load(std::memory_order_relaxed);
  }

  // Registers the family's reclaimer. Call during start-up, before shards run.
  void SetReclaimer(MemFamily f, Reclaimer r) { reclaimers_[static_cast<int>(f)] = std::move(r); }

  // Charges bytes to the family, or returns kOom. Unlimited when maxmemory is 0.
  Status Reserve(MemFamily f, uint64_t bytes);
  // Charges without an admission check (memory already in use, e.g. client buffers).
  void Charge(MemFamily f, uint64_t bytes);
  void Release(MemFamily f, uint64_t bytes);

  // A store's budget charged to family f (what every family hands its per-shard store).
  store::ByteBudget BudgetFor(MemFamily f) {
    return {[this, f](uint64_t n) { return Reserve(f, n); },
            [this, f](uint64_t n) { Release(f, n); }};
  }

  uint64_t oom_rejections() const { return oom_rejections_.load(std::memory_order_relaxed); }

 private:
  bool TryAdd(MemFamily f, uint64_t bytes);

  std::atomic<uint64_t> max_{0};
  std::atomic<uint64_t> used_{0};
  std::array<std::atomic<uint64_t>, static_cast<int>(MemFamily::kCount)> by_family_{};
  std::array<std::atomic<uint64_t>, static_cast<int>(MemFamily::kCount)> limits_{};
  std::array<Reclaimer, static_cast<int>(MemFamily::kCount)> reclaimers_{};
  std::atomic<uint64_t> oom_rejections_{0};
};

}  // namespace pion::server
