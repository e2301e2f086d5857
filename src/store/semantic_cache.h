// SemanticCache: KV.STORE / KV.FETCH — tensors (e.g. a prompt's K/V) stored under an embedding
// of what produced them and fetched by the nearest stored embedding (cosine), for engines that
// reuse work across similar prompts (seed 000 §KV.STORE, done properly):
//   - MODEL is an identity fence: a fetch sees only entries stored with the same model id (or,
//     without MODEL, only entries stored without one), never another model's tensors;
//   - TTL is enforced: an expired entry is never returned (and is reclaimed first);
//   - capacity (entries per tenant, --kv-cache-capacity) and the `index` memory budget bound it,
//     evicting the tenant's least recently used entries;
//   - tenants never see each other's entries.
// Thread-safe (one mutex): KV.* are keyless and run on whichever shard holds the connection.
#pragma once

#include <chrono>
#include <cstdint>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/buffer.h"
#include "common/byte_budget.h"
#include "common/status.h"

namespace pion::store {

class SemanticCache {
 public:
  using Clock = std::chrono::steady_clock;

  SemanticCache(uint64_t capacity, ByteBudget budget)
      : capacity_(capacity), budget_(std::move(budget)) {}

  // Stores an entry; its id (unique, never reused). key: dim floats (normalized here; a zero
  // vector is refused). ttl 0: no expiry.
  StatusOr<uint64_t> Store(uint32_t tenant, const float* key, uint32_t dim, BufferRef tensor,
                           std::string model, std::chrono::milliseconds ttl);

  struct Hit {
    uint64_t id = 0;
    float similarity = 0;
    std::string model;
    BufferRef tensor;
  };
  // The entry nearest to q (same dim, same model, not expired) when its cosine similarity is at
  // least `threshold`; nullopt otherwise (a miss). A hit becomes the most recently used.
  std::optional<Hit> Fetch(uint32_t tenant, const float* q, uint32_t dim,
                           const std::optional<std::string>& model, float threshold);

  // KV.EVICT: one id, every entry, or the expired ones. Returns how many went.
  size_t EvictId(uint32_t tenant, uint64_t id);
  size_t EvictAll(uint32_t tenant);
  size_t EvictExpired(uint32_t tenant);

  struct Stats {
    uint64_t entries = 0, blob_bytes = 0, hits = 0, misses = 0, capacity = 0, evictions = 0,
             expired = 0;
  };
  Stats StatsOf(uint32_t tenant) const;
  void set_capacity(uint64_t c);
  uint64_t capacity() const;

 private:
  struct Entry {
    uint64_t id = 0;
    std::vector<float> key;  // unit length
    BufferRef tensor;
    std::string model;
    Clock::time_point expires;  // time_point::max(): never
    std::list<uint64_t>::iterator lru;
    uint64_t bytes = 0;
  };
  struct Tenant {
    std::unordered_map<uint64_t, Entry> entries;
    std::list<uint64_t> lru;  // most recently used first
    uint64_t blob_bytes = 0, hits = 0, misses = 0, evictions = 0, expired = 0;
  };
  void Remove(Tenant& t, uint64_t id);  // mu_ held
  bool EvictLru(Tenant& t);             // mu_ held; false when empty
  size_t SweepExpired(Tenant& t, Clock::time_point now);

  mutable std::mutex mu_;
  uint64_t capacity_;
  ByteBudget budget_;
  uint64_t next_id_ = 1;
  std::unordered_map<uint32_t, Tenant> tenants_;
};

}  // namespace pion::store
