#include "store/ssm_store.h"

namespace pion::store {

void SsmStore::Publish() {
  sessions_gauge_.store(sessions_.size(), std::memory_order_relaxed);
  blobs_gauge_.store(blobs_, std::memory_order_relaxed);
  bytes_gauge_.store(bytes_, std::memory_order_relaxed);
}

SsmStore::Session* SsmStore::Find(const TenantKey& sid) {
  auto it = sessions_.find(sid);
  return it == sessions_.end() ? nullptr : &it->second;
}

SsmStore::Session& SsmStore::Get(const TenantKey& sid) {
  auto [it, inserted] = sessions_.try_emplace(sid);
  if (inserted) {
    it->second.incarnation = next_incarnation_++;
    Publish();
  }
  return it->second;
}

void SsmStore::Put(const TenantKey& sid, uint64_t layer, residency::ObjectRef blob) {
  Session& s = Get(sid);
  const uint64_t size = blob->bytes();
  auto [it, inserted] = s.layers.try_emplace(layer, blob);
  if (!inserted) {
    bytes_ -= it->second->bytes();
    it->second = std::move(blob);  // a reply still sending the old blob keeps it alive
  } else {
    ++blobs_;
  }
  bytes_ += size;
  ++s.writes;
  Publish();
}

residency::ObjectRef SsmStore::Blob(const TenantKey& sid, uint64_t layer) const {
  auto it = sessions_.find(sid);
  if (it == sessions_.end()) return nullptr;
  auto l = it->second.layers.find(layer);
  return l == it->second.layers.end() ? nullptr : l->second;
}

size_t SsmStore::Drop(const TenantKey& sid, std::optional<uint64_t> layer) {
  auto it = sessions_.find(sid);
  if (it == sessions_.end()) return 0;
  size_t dropped = 0;
  auto drop_one = [&](std::map<uint64_t, residency::ObjectRef>::iterator l) {
    bytes_ -= l->second->bytes();
    --blobs_;
    ++dropped;
    return it->second.layers.erase(l);
  };
  if (layer) {
    auto l = it->second.layers.find(*layer);
    if (l != it->second.layers.end()) {
      drop_one(l);
      ++it->second.writes;
    }
    if (it->second.layers.empty() && !it->second.saved) sessions_.erase(it);
  } else {
    for (auto l = it->second.layers.begin(); l != it->second.layers.end();) l = drop_one(l);
    sessions_.erase(it);
  }
  Publish();
  return dropped;
}

}  // namespace pion::store
