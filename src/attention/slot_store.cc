#include "attention/slot_store.h"

namespace pion::attention {

namespace {
std::atomic<uint64_t> next_generation{1};
}  // namespace

uint64_t NextSlotGeneration() { return next_generation.fetch_add(1, std::memory_order_relaxed); }

void NoteSlotGeneration(uint64_t g) {
  // Generations found on disk stay below every new one: a fence outlives a restart.
  uint64_t cur = next_generation.load(std::memory_order_relaxed);
  while (cur <= g && !next_generation.compare_exchange_weak(cur, g + 1)) {
  }
}

StatusOr<std::shared_ptr<Summaries>> Slot::SummariesFor(uint32_t b,
                                                        const ByteBudget* budget) const {
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

void SlotStore::Publish(const store::TenantKey& sid, uint32_t layer, SlotRef slot) {
  auto& layers = sessions_[sid];
  auto [it, inserted] = layers.try_emplace(layer, Entry{slot, std::nullopt});
  if (!inserted) {
    bytes_ -= it->second.slot->bytes();
    it->second.slot = std::move(slot);  // a query holding the old slot finishes on it
  } else {
    ++slots_;
  }
  bytes_ += it->second.slot->bytes();
  PublishGauges();
}

SlotRef SlotStore::Find(const store::TenantKey& sid, uint32_t layer) const {
  auto s = sessions_.find(sid);
  if (s == sessions_.end()) return nullptr;
  auto it = s->second.find(layer);
  return it == s->second.end() ? nullptr : it->second.slot;
}

const SlotStore::Saved* SlotStore::SavedOf(const store::TenantKey& sid, uint32_t layer) const {
  auto s = sessions_.find(sid);
  if (s == sessions_.end()) return nullptr;
  auto it = s->second.find(layer);
  return it == s->second.end() || !it->second.saved ? nullptr : &*it->second.saved;
}

void SlotStore::SetSaved(const store::TenantKey& sid, uint32_t layer, Saved saved) {
  auto s = sessions_.find(sid);
  if (s == sessions_.end()) return;
  auto it = s->second.find(layer);
  if (it != s->second.end()) it->second.saved = std::move(saved);
}

size_t SlotStore::Drop(const store::TenantKey& sid, std::optional<uint32_t> layer) {
  auto s = sessions_.find(sid);
  if (s == sessions_.end()) return 0;
  size_t dropped = 0;
  auto drop = [&](std::map<uint32_t, Entry>::iterator it) {
    bytes_ -= it->second.slot->bytes();
    --slots_;
    ++dropped;
    return s->second.erase(it);
  };
  if (layer) {
    auto it = s->second.find(*layer);
    if (it != s->second.end()) drop(it);
  } else {
    for (auto it = s->second.begin(); it != s->second.end();) it = drop(it);
  }
  if (s->second.empty()) sessions_.erase(s);
  PublishGauges();
  return dropped;
}

std::vector<std::pair<uint32_t, SlotRef>> SlotStore::Layers(const store::TenantKey& sid) const {
  std::vector<std::pair<uint32_t, SlotRef>> out;
  auto s = sessions_.find(sid);
  if (s == sessions_.end()) return out;
  for (const auto& [layer, e] : s->second) out.emplace_back(layer, e.slot);
  return out;
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
