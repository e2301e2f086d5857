// SsmStore: recurrent-state blobs (seed 002 SSM.PREFIX.*) keyed by (tenant, session, layer).
//
// Blobs are opaque and kept as the Buffer the request arrived in (no copy, no size ceiling
// beyond --proto-max-bulk-len). Each blob's bytes are charged to the budget for as long as it
// is stored. Runs on the owning shard; Total() is readable from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <unordered_map>

#include "common/buffer.h"
#include "store/tenant_key.h"
#include "store/vsession.h"

namespace pion::store {

class SsmStore {
 public:
  void set_budget(ByteBudget b) { budget_ = std::move(b); }

  // Stores (or replaces) the blob of one layer. kOom leaves the old blob in place.
  Status Store(const TenantKey& sid, uint64_t layer, BufferRef blob);
  // The layer's blob, or nullptr.
  BufferRef Fetch(const TenantKey& sid, uint64_t layer) const;
  // Drops one layer, or every layer when layer is nullopt. Returns how many were dropped.
  size_t Drop(const TenantKey& sid, std::optional<uint64_t> layer);

  struct Usage {
    uint64_t sessions = 0;
    uint64_t blobs = 0;
    uint64_t bytes = 0;
  };
  Usage Total() const {
    return {sessions_gauge_.load(std::memory_order_relaxed),
            blobs_gauge_.load(std::memory_order_relaxed),
            bytes_gauge_.load(std::memory_order_relaxed)};
  }

 private:
  void Publish();

  ByteBudget budget_;
  std::unordered_map<TenantKey, std::map<uint64_t, BufferRef>, TenantKeyHash> sessions_;
  uint64_t blobs_ = 0;
  uint64_t bytes_ = 0;
  std::atomic<uint64_t> sessions_gauge_{0};
  std::atomic<uint64_t> blobs_gauge_{0};
  std::atomic<uint64_t> bytes_gauge_{0};
};

}  // namespace pion::store
