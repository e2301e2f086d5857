#include "attention/slot_store.h"

namespace pion::attention {

uint64_t NextSlotGeneration() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

StatusOr<std::shared_ptr<Summaries>> Slot::SummariesFor(uint32_t b,
                                                        const store::ByteBudget* budget) const {
  for (auto it = summaries_.begin(); it != summaries_.end(); ++it) {
    if ((*it)->block == b) {
      summaries_.splice(summaries_.begin(), summaries_, it);
      return summaries_.front();
    }
  }
  auto s = std::make_shared<Summaries>();
  s->block = b;
  s->nblocks = (rows + b - 1) / b;
  const size_t n = static_cast<size_t>(heads) * s->nblocks * d;
  const uint64_t bytes = 3 * n * sizeof(float);
  if (budget != nullptr && budget->reserve) {
    Status st = budget->reserve(bytes);
    if (!st.ok()) return st;
    s->charge = std::make_unique<Charge>(budget, bytes);
  }
  if (gpu) {
    auto mem = gpu::Allocate(bytes);
    if (!mem.ok()) return mem.status();
    s->dev = std::move(mem).value();
  } else {
    s->mean.resize(n);
    s->min.resize(n);
    s->max.resize(n);
  }
  summaries_.push_front(s);
  if (summaries_.size() > kMaxSummaries) summaries_.pop_back();
  return s;
}

StatusOr<std::unique_ptr<Charge>> SlotStore::Reserve(uint64_t bytes) {
  if (budget_.reserve) {
    Status s = budget_.reserve(bytes);
    if (!s.ok()) return s;
  }
  return std::make_unique<Charge>(budget_.release ? &budget_ : nullptr, bytes);
}

void SlotStore::Publish(const store::TenantKey& sid, uint32_t layer, SlotRef slot) {
  auto& layers = sessions_[sid];
  auto it = layers.find(layer);
  if (it != layers.end()) {
    bytes_ -= it->second.slot->bytes();
    it->second.slot = std::move(slot);
    bytes_ += it->second.slot->bytes();
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  } else {
    lru_.push_front(Key{sid, layer});
    bytes_ += slot->bytes();
    layers.emplace(layer, Entry{std::move(slot), lru_.begin()});
    ++slots_;
  }
  PublishGauges();
}

SlotRef SlotStore::Find(const store::TenantKey& sid, uint32_t layer) {
  auto s = sessions_.find(sid);
  if (s == sessions_.end()) return nullptr;
  auto it = s->second.find(layer);
  if (it == s->second.end()) return nullptr;
  if (it->second.slot->gone()) {  // its GPU copy was evicted: unlink it now
    Unlink(s->second, it);
    if (s->second.empty()) sessions_.erase(s);
    evictions_.fetch_add(1, std::memory_order_relaxed);
    PublishGauges();
    return nullptr;
  }
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return it->second.slot;
}

size_t SlotStore::SweepGone() {
  size_t n = 0;
  for (auto s = sessions_.begin(); s != sessions_.end();) {
    for (auto it = s->second.begin(); it != s->second.end();) {
      auto next = std::next(it);
      if (it->second.slot->gone()) {
        Unlink(s->second, it);
        evictions_.fetch_add(1, std::memory_order_relaxed);
        ++n;
      }
      it = next;
    }
    s = s->second.empty() ? sessions_.erase(s) : std::next(s);
  }
  if (n > 0) PublishGauges();
  return n;
}

void SlotStore::Unlink(std::map<uint32_t, Entry>& layers, std::map<uint32_t, Entry>::iterator it) {
  bytes_ -= it->second.slot->bytes();
  --slots_;
  lru_.erase(it->second.lru);
  layers.erase(it);
}

size_t SlotStore::Drop(const store::TenantKey& sid, std::optional<uint32_t> layer) {
  auto s = sessions_.find(sid);
  if (s == sessions_.end()) return 0;
  size_t dropped = 0;
  if (layer) {
    auto it = s->second.find(*layer);
    if (it != s->second.end()) {
      Unlink(s->second, it);
      dropped = 1;
    }
  } else {
    while (!s->second.empty()) {
      Unlink(s->second, s->second.begin());
      ++dropped;
    }
  }
  if (s->second.empty()) sessions_.erase(s);
  PublishGauges();
  return dropped;
}

std::vector<std::pair<uint32_t, SlotRef>> SlotStore::Layers(const store::TenantKey& sid) const {
  std::vector<std::pair<uint32_t, SlotRef>> out;
  auto s = sessions_.find(sid);
  if (s == sessions_.end()) return out;
  for (const auto& [layer, e] : s->second) {
    if (!e.slot->gone()) out.emplace_back(layer, e.slot);
  }
  return out;
}

uint64_t SlotStore::EvictForRoom(uint64_t bytes) {
  uint64_t released = 0;
  for (auto k = lru_.end(); released < bytes && k != lru_.begin();) {
    --k;
    auto s = sessions_.find(k->sid);
    auto it = s->second.find(k->layer);
    if (it->second.slot->host_bytes() == 0) continue;  // GPU slots hold no host memory
    k = std::next(k);                                  // Unlink erases the LRU node under k
    released += it->second.slot->host_bytes();
    Unlink(s->second, it);
    if (s->second.empty()) sessions_.erase(s);
    evictions_.fetch_add(1, std::memory_order_relaxed);
  }
  PublishGauges();
  return released;
}

SlotStore::Usage SlotStore::UsageOf(uint32_t tenant) const {
  Usage u;
  for (const auto& [sid, layers] : sessions_) {
    if (sid.tenant != tenant) continue;
    ++u.sessions;
    for (const auto& [layer, e] : layers) {
      ++u.slots;
      u.bytes += e.slot->bytes();
    }
  }
  return u;
}

void SlotStore::PublishGauges() {
  sessions_gauge_.store(sessions_.size(), std::memory_order_relaxed);
  slots_gauge_.store(slots_, std::memory_order_relaxed);
  bytes_gauge_.store(bytes_, std::memory_order_relaxed);
}

}  // namespace pion::attention
