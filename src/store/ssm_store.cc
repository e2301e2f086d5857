#include "store/ssm_store.h"

namespace pion::store {

void SsmStore::Publish() {
  sessions_gauge_.store(sessions_.size(), std::memory_order_relaxed);
  blobs_gauge_.store(blobs_, std::memory_order_relaxed);
  bytes_gauge_.store(bytes_, std::memory_order_relaxed);
}

Status SsmStore::Store(const TenantKey& sid, uint64_t layer, BufferRef blob) {
  const uint64_t size = blob->size();
  if (budget_.reserve) {
    Status s = budget_.reserve(size);
    if (!s.ok()) return s;
  }
  auto& layers = sessions_[sid];
  auto [it, inserted] = layers.try_emplace(layer, blob);
  if (!inserted) {
    uint64_t old = it->second->size();
    it->second = std::move(blob);  // a reply still sending the old blob keeps it alive
    bytes_ -= old;
    if (budget_.release) budget_.release(old);
  } else {
    ++blobs_;
  }
  bytes_ += size;
  Publish();
  return Status::Ok();
}

BufferRef SsmStore::Fetch(const TenantKey& sid, uint64_t layer) const {
  auto it = sessions_.find(sid);
  if (it == sessions_.end()) return nullptr;
  auto l = it->second.find(layer);
  return l == it->second.end() ? nullptr : l->second;
}

size_t SsmStore::Drop(const TenantKey& sid, std::optional<uint64_t> layer) {
  auto it = sessions_.find(sid);
  if (it == sessions_.end()) return 0;
  size_t dropped = 0;
  auto drop_one = [&](std::map<uint64_t, BufferRef>::iterator l) {
    uint64_t size = l->second->size();
    bytes_ -= size;
    --blobs_;
    if (budget_.release) budget_.release(size);
    ++dropped;
    return it->second.erase(l);
  };
  if (layer) {
    auto l = it->second.find(*layer);
    if (l != it->second.end()) drop_one(l);
  } else {
    for (auto l = it->second.begin(); l != it->second.end();) l = drop_one(l);
  }
  if (it->second.empty()) sessions_.erase(it);
  Publish();
  return dropped;
}

}  // namespace pion::store
