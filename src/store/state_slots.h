// StateSlots: fixed-size, overwrite-in-place buffers for per-request state (seed 000 STATE.*).
//
// Unlike the caches, a slot is never evicted or grown: it holds exactly the bytes it was
// allocated with until it is freed, and every access is bounds-checked. One StateSlots lives
// on each shard and holds the slots whose ids hash to that shard. Runs on the owning shard.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string_view>
#include <unordered_map>

#include "common/buffer.h"
#include "common/byte_budget.h"
#include "common/status.h"
#include "store/tenant_key.h"

namespace pion::store {

class StateSlots {
 public:
  // Charges/releases the slots' bytes against the memory limit.
  void set_budget(ByteBudget b) { budget_ = std::move(b); }

  // Creates a zero-filled slot. Allocating an existing id with the same size is a no-op
  // (the contents are kept); with a different size it is an error.
  Status Alloc(const TenantKey& key, uint64_t size);
  // Overwrites bytes [offset, offset+data.size()). Out-of-range writes are errors.
  Status Write(const TenantKey& key, uint64_t offset, std::string_view data);
  // Returns a view of [offset, offset+len) and the slot's buffer (keeps the bytes alive).
  StatusOr<BufferRef> Read(const TenantKey& key, uint64_t offset, uint64_t len,
                           const uint8_t** begin);
  // Returns true if the slot existed.
  bool Free(const TenantKey& key);

  struct Usage {
    uint64_t slots = 0;
    uint64_t bytes = 0;
  };
  Usage UsageOf(uint32_t tenant) const;
  // Thread-safe snapshot (INFO keyspace reads it from other threads).
  Usage Total() const {
    return {slot_gauge_.load(std::memory_order_relaxed),
            bytes_gauge_.load(std::memory_order_relaxed)};
  }

 private:
  StatusOr<BufferRef> Find(const TenantKey& key) const;

  std::unordered_map<TenantKey, BufferRef, TenantKeyHash> slots_;
  uint64_t bytes_ = 0;
  std::atomic<uint64_t> slot_gauge_{0};
  std::atomic<uint64_t> bytes_gauge_{0};
  void PublishGauges() {
    slot_gauge_.store(slots_.size(), std::memory_order_relaxed);
    bytes_gauge_.store(bytes_, std::memory_order_relaxed);
  }
  ByteBudget budget_;
};

}  // namespace pion::store
