// SsmStore: recurrent-state blobs (seed 002 SSM.PREFIX.*) keyed by (tenant, session, layer),
// each blob one residency object (residency/object.h) of one block — host-resident when it is
// stored (the request's own buffer, adopted without a copy), demoted to disk under pressure,
// brought back on FETCH. A session's SSM.PREFIX.SAVE is one durable object file; its
// DiskFile is kept here so DROP can delete it and start-up can find it again.
// Runs on the owning shard; Total() is readable from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>

#include "residency/disk_file.h"
#include "residency/object.h"
#include "store/durable.h"
#include "store/tenant_key.h"

namespace pion::store {

class SsmStore {
 public:
  // Its saves (store/durable.h): `writes` counts STOREs and layer DROPs; the newest
  // SSM.PREFIX.SAVE.
  struct Session : Durable {
    std::map<uint64_t, residency::ObjectRef> layers;
  };

  Session* Find(const TenantKey& sid);
  Session& Get(const TenantKey& sid);  // creates an empty session when absent
  // Stores (or replaces) the layer's blob object.
  void Put(const TenantKey& sid, uint64_t layer, residency::ObjectRef blob);
  // The layer's blob object, or null.
  residency::ObjectRef Blob(const TenantKey& sid, uint64_t layer) const;
  // Drops one layer, or the whole session (saved copy forgotten too) when layer is nullopt.
  // Returns how many blobs were dropped.
  size_t Drop(const TenantKey& sid, std::optional<uint64_t> layer);
  // The version the next save of sid writes: above every version written for the name,
  // across DROP and restarts (NoteVersion records versions found on disk).
  uint64_t NextVersion(const TenantKey& sid) { return ++versions_[sid]; }
  void NoteVersion(const TenantKey& sid, uint64_t v) {
    if (v > versions_[sid]) versions_[sid] = v;
  }

  template <typename F>
  void ForEach(uint32_t tenant, F&& f) const {
    for (const auto& [k, s] : sessions_) {
      if (k.tenant == tenant) f(k, s);
    }
  }

  // Every session of every tenant.
  template <typename F>
  void ForEachSession(F&& f) const {
    for (const auto& [k, s] : sessions_) f(k, s);
  }

  struct Usage {
    uint64_t sessions = 0;
    uint64_t blobs = 0;
    uint64_t bytes = 0;  // whichever tier holds them
  };
  Usage Total() const {
    return {sessions_gauge_.load(std::memory_order_relaxed),
            blobs_gauge_.load(std::memory_order_relaxed),
            bytes_gauge_.load(std::memory_order_relaxed)};
  }

 private:
  void Publish();

  std::unordered_map<TenantKey, Session, TenantKeyHash> sessions_;
  std::unordered_map<TenantKey, uint64_t, TenantKeyHash> versions_;
  uint64_t next_incarnation_ = 1;
  uint64_t blobs_ = 0;
  uint64_t bytes_ = 0;
  std::atomic<uint64_t> sessions_gauge_{0};
  std::atomic<uint64_t> blobs_gauge_{0};
  std::atomic<uint64_t> bytes_gauge_{0};
};

}  // namespace pion::store
