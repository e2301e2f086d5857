// StateSlots: fixed-size, overwrite-in-place buffers for per-request state (seed 000 STATE.*).
//
// A slot is never grown and never lost: it holds exactly the bytes it was allocated with until
// it is freed, and every access is bounds-checked. Its bytes are one residency object
// (residency/object.h): host-resident while used, moved to disk under memory pressure and
// brought back on the next access. A write changes the bytes in place when nobody else holds
// them (a READ reply in flight, a save, a demotion), and copies first otherwise, so what a
// reader took never changes. STATE.SAVE makes a slot durable; the saved file is kept here.
// One StateSlots lives on each shard and holds the slots whose ids hash to it; runs on the
// owning shard.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>
#include <unordered_map>

#include "common/status.h"
#include "residency/disk_file.h"
#include "residency/object.h"
#include "store/durable.h"
#include "store/tenant_key.h"

namespace pion::store {

class StateSlots {
 public:
  // Its saves (store/durable.h): `writes` counts WRITEs; the newest STATE.SAVE.
  struct Slot : Durable {
    residency::ObjectRef obj;  // one block of `size` bytes
    uint64_t size = 0;
  };

  // kErr "no such state slot" when absent.
  StatusOr<Slot*> Find(const TenantKey& key);
  // Ok with *exists when a slot of that size is there (ALLOC is idempotent); an error naming
  // both sizes when it exists with another; Ok and !*exists when it is new.
  Status CheckAlloc(const TenantKey& key, uint64_t size, bool* exists) const;
  Slot& Insert(const TenantKey& key, residency::ObjectRef obj);
  // kErr when [offset, offset + len) is not inside the slot (`what`: "write", "read").
  static Status CheckRange(const TenantKey& key, const Slot& slot, uint64_t offset, uint64_t len,
                           std::string_view what);
  // Writes in place when the object allows it (see class comment); false when it must be
  // copied first (the caller makes the copy and Replace()s). `own_host_pins`: the pins the
  // writer holds on the slot's object (it keeps it in memory through the write).
  static bool WriteInPlace(Slot& slot, uint64_t offset, std::string_view data,
                           uint32_t own_host_pins);
  void Replace(Slot& slot, residency::ObjectRef obj);
  // Returns true if the slot existed.
  bool Free(const TenantKey& key);
  uint64_t NextVersion(const TenantKey& key) { return ++versions_[key]; }
  void NoteVersion(const TenantKey& key, uint64_t v) {
    if (v > versions_[key]) versions_[key] = v;
  }

  template <typename F>
  void ForEach(F&& f) {
    for (auto& [k, s] : slots_) f(k, s);
  }

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
  void PublishGauges() {
    slot_gauge_.store(slots_.size(), std::memory_order_relaxed);
    bytes_gauge_.store(bytes_, std::memory_order_relaxed);
  }

  std::unordered_map<TenantKey, Slot, TenantKeyHash> slots_;
  std::unordered_map<TenantKey, uint64_t, TenantKeyHash> versions_;
  uint64_t next_incarnation_ = 1;
  uint64_t bytes_ = 0;
  std::atomic<uint64_t> slot_gauge_{0};
  std::atomic<uint64_t> bytes_gauge_{0};
};

}  // namespace pion::store
