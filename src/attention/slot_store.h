// SlotStore: the ATTEND.PREFIX slots a shard owns — one layer's K and V per (session, layer),
// resident in memory so the server attends over them instead of shipping them back.
//
// A Slot is immutable once published: STORE builds a new one (reserve → copy/convert →
// validate) and Publish() swaps it in, so a query that took the old slot keeps computing on it
// and never sees a mix; the old slot's memory goes back to the budget when its last reader
// drops it. Slots are evicted in LRU order when the attention budget needs room (the
// MemoryAccountant's reclaimer calls EvictForRoom on the reserving shard).
//
// Block summaries (mean/min/max of K per block of B rows, for QUERY_SPARSE_AUTO) are cached on
// the slot per block size: created on the shard (where their bytes are reserved) and filled once
// by the first query that needs them, on a compute thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "attention/gpu_slots.h"
#include "common/buffer.h"
#include "common/byte_budget.h"
#include "common/status.h"
#include "kernels/attention.h"
#include "store/tenant_key.h"

namespace pion::attention {

using pion::Charge;

struct Summaries {
  uint32_t block = 0;
  uint32_t nblocks = 0;
  std::vector<float> mean, min, max;  // [heads][nblocks][d] (host slots)
  gpu::DeviceMemory dev;              // GPU slots: mean, min, max back to back
  std::once_flag filled;
  Status fill_status;  // set by the filling query (GPU slots can fail)
  std::unique_ptr<Charge> charge;

  size_t elems() const { return mean.empty() ? dev.size() / (3 * sizeof(float)) : mean.size(); }
  const float* dev_mean() const { return static_cast<const float*>(dev.data()); }
  const float* dev_min() const { return dev_mean() + elems(); }
  const float* dev_max() const { return dev_mean() + 2 * elems(); }

  kernels::BlockSummaries View(uint32_t heads, uint32_t d) {
    return {mean.data(), min.data(), max.data(), heads, nblocks, block, d};
  }
};

struct Slot {
  uint32_t heads = 0;
  uint32_t rows = 0;  // N, prefix tokens
  uint32_t d = 0;
  kernels::DType dtype = kernels::DType::kF32;
  BufferRef k, v;                  // [heads][rows][d] of dtype
  uint64_t generation = 0;         // unique per published slot, store-wide
  std::string source;              // "" for STORE with blobs; "<ns>@<publication>" for STORE FROM
  std::unique_ptr<Charge> charge;  // host bytes (k, v)
  // --attention-backend cuda: K and V live on the GPU instead (k, v and charge are empty).
  std::shared_ptr<GpuCopy> gpu;

  kernels::Tensor3 K() const { return {k->data(), dtype, heads, rows, d}; }
  kernels::Tensor3 V() const { return {v->data(), dtype, heads, rows, d}; }
  uint64_t host_bytes() const { return charge ? charge->bytes() : 0; }
  uint64_t bytes() const { return gpu ? gpu->bytes() : host_bytes(); }
  // A GPU slot whose device copy was evicted: it reads as absent.
  bool gone() const { return gpu != nullptr && gpu->evicted(); }

  // Shard thread only: the summaries for block size b, creating (and charging) them if needed.
  // At most kMaxSummaries block sizes are cached per slot; the least recently used is dropped.
  StatusOr<std::shared_ptr<Summaries>> SummariesFor(uint32_t b,
                                                    const store::ByteBudget* budget) const;
  static constexpr size_t kMaxSummaries = 4;

 private:
  mutable std::list<std::shared_ptr<Summaries>> summaries_;  // most recently used first
};

using SlotRef = std::shared_ptr<const Slot>;

// Generations of published slots, unique across shards.
uint64_t NextSlotGeneration();

class SlotStore {
 public:
  void set_budget(store::ByteBudget b) { budget_ = std::move(b); }
  const store::ByteBudget* budget() const { return &budget_; }

  // Reserves bytes for a slot about to be built; the Charge releases them if the slot is never
  // published. kOom when the budget refuses (after the reclaimer evicted what it could).
  StatusOr<std::unique_ptr<Charge>> Reserve(uint64_t bytes);

  // Publishes a slot (replacing any previous slot of the same session and layer).
  void Publish(const store::TenantKey& sid, uint32_t layer, SlotRef slot);
  // The slot, or null. Marks it recently used.
  SlotRef Find(const store::TenantKey& sid, uint32_t layer);
  // Drops one layer, or every layer of the session. Returns how many slots were dropped.
  size_t Drop(const store::TenantKey& sid, std::optional<uint32_t> layer);
  // Layers of a session, in order (for ATTEND.PREFIX.INFO).
  std::vector<std::pair<uint32_t, SlotRef>> Layers(const store::TenantKey& sid) const;
  // Evicts least recently used slots holding host memory until `bytes` were released or none
  // is left. Returns the bytes released (a slot a query still holds is unlinked now; its memory
  // returns when the query finishes).
  uint64_t EvictForRoom(uint64_t bytes);
  // Unlinks GPU slots whose device copy was evicted (GpuSlots LRU); returns how many.
  size_t SweepGone();

  struct Usage {
    uint64_t sessions = 0;
    uint64_t slots = 0;
    uint64_t bytes = 0;
    uint64_t evictions = 0;
  };
  // Readable from any thread.
  Usage Total() const {
    return {sessions_gauge_.load(std::memory_order_relaxed),
            slots_gauge_.load(std::memory_order_relaxed),
            bytes_gauge_.load(std::memory_order_relaxed),
            evictions_.load(std::memory_order_relaxed)};
  }
  Usage UsageOf(uint32_t tenant) const;

 private:
  struct Key {
    store::TenantKey sid;
    uint32_t layer;
  };
  using Lru = std::list<Key>;
  struct Entry {
    SlotRef slot;
    Lru::iterator lru;
  };
  void Unlink(std::map<uint32_t, Entry>& layers, std::map<uint32_t, Entry>::iterator it);
  void PublishGauges();

  store::ByteBudget budget_;
  std::unordered_map<store::TenantKey, std::map<uint32_t, Entry>, store::TenantKeyHash> sessions_;
  Lru lru_;  // most recently used at the front
  uint64_t slots_ = 0;
  uint64_t bytes_ = 0;
  std::atomic<uint64_t> sessions_gauge_{0};
  std::atomic<uint64_t> slots_gauge_{0};
  std::atomic<uint64_t> bytes_gauge_{0};
  std::atomic<uint64_t> evictions_{0};
};

}  // namespace pion::attention
