#include "store/semantic_cache.h"

#include <cmath>

namespace pion::store {

namespace {
uint64_t EntryBytes(uint32_t dim, const BufferRef& t, size_t model) {
  return uint64_t{dim} * sizeof(float) + (t ? t->size() : 0) + model + 128;
}
}  // namespace

void SemanticCache::Remove(Tenant& t, uint64_t id) {
  auto it = t.entries.find(id);
  if (it == t.entries.end()) return;
  t.lru.erase(it->second.lru);
  t.blob_bytes -= it->second.tensor ? it->second.tensor->size() : 0;
  if (budget_.release) budget_.release(it->second.bytes);
  t.entries.erase(it);
}

bool SemanticCache::EvictLru(Tenant& t) {
  if (t.lru.empty()) return false;
  Remove(t, t.lru.back());
  ++t.evictions;
  return true;
}

size_t SemanticCache::SweepExpired(Tenant& t, Clock::time_point now) {
  std::vector<uint64_t> gone;
  for (const auto& [id, e] : t.entries) {
    if (e.expires <= now) gone.push_back(id);
  }
  for (uint64_t id : gone) Remove(t, id);
  t.expired += gone.size();
  return gone.size();
}

StatusOr<uint64_t> SemanticCache::Store(uint32_t tenant, const float* key, uint32_t dim,
                                        BufferRef tensor, std::string model,
                                        std::chrono::milliseconds ttl) {
  double norm = 0;
  for (uint32_t j = 0; j < dim; ++j) norm += double{key[j]} * key[j];
  if (!(norm > 0) || !std::isfinite(norm)) {
    return Error("key_embedding must be a finite, non-zero vector (cosine needs a direction)");
  }
  Entry e;
  e.key.resize(dim);
  const double inv = 1.0 / std::sqrt(norm);
  for (uint32_t j = 0; j < dim; ++j) e.key[j] = static_cast<float>(key[j] * inv);
  e.bytes = EntryBytes(dim, tensor, model.size());
  e.tensor = std::move(tensor);
  e.model = std::move(model);
  const auto now = Clock::now();
  e.expires = ttl.count() > 0 ? now + ttl : Clock::time_point::max();

  std::lock_guard lock(mu_);
  Tenant& t = tenants_[tenant];
  // Room: expired entries first, then the least recently used, for the count and the bytes.
  if (t.entries.size() >= capacity_) SweepExpired(t, now);
  while (t.entries.size() >= capacity_ && EvictLru(t)) {
  }
  if (capacity_ == 0) return Status(ErrorKind::kOom, "the KV cache capacity is 0");
  if (budget_.reserve) {
    Status st = budget_.reserve(e.bytes);
    while (!st.ok() && (SweepExpired(t, now) > 0 || EvictLru(t))) st = budget_.reserve(e.bytes);
    if (!st.ok()) return st;
  }
  const uint64_t id = next_id_++;
  e.id = id;
  t.lru.push_front(id);
  e.lru = t.lru.begin();
  t.blob_bytes += e.tensor ? e.tensor->size() : 0;
  t.entries.emplace(id, std::move(e));
  return id;
}

std::optional<SemanticCache::Hit> SemanticCache::Fetch(uint32_t tenant, const float* q,
                                                       uint32_t dim,
                                                       const std::optional<std::string>& model,
                                                       float threshold) {
  double norm = 0;
  for (uint32_t j = 0; j < dim; ++j) norm += double{q[j]} * q[j];
  const auto now = Clock::now();
  std::lock_guard lock(mu_);
  Tenant& t = tenants_[tenant];
  const Entry* best = nullptr;
  double best_sim = -2;
  if (norm > 0 && std::isfinite(norm)) {
    const double inv = 1.0 / std::sqrt(norm);
    const std::string& want = model ? *model : std::string();
    for (const auto& [id, e] : t.entries) {
      if (e.key.size() != dim || e.model != want || e.expires <= now) continue;
      double s = 0;
      for (uint32_t j = 0; j < dim; ++j) s += double{q[j]} * e.key[j];
      s *= inv;
      if (s > best_sim || (s == best_sim && best != nullptr && e.id < best->id)) {
        best_sim = s;
        best = &e;
      }
    }
  }
  if (best == nullptr || best_sim < threshold) {
    ++t.misses;
    return std::nullopt;
  }
  ++t.hits;
  t.lru.splice(t.lru.begin(), t.lru, best->lru);
  return Hit{best->id, static_cast<float>(best_sim), best->model, best->tensor};
}

size_t SemanticCache::EvictId(uint32_t tenant, uint64_t id) {
  std::lock_guard lock(mu_);
  Tenant& t = tenants_[tenant];
  const size_t before = t.entries.size();
  Remove(t, id);
  return before - t.entries.size();
}

size_t SemanticCache::EvictAll(uint32_t tenant) {
  std::lock_guard lock(mu_);
  Tenant& t = tenants_[tenant];
  const size_t n = t.entries.size();
  while (!t.lru.empty()) Remove(t, t.lru.back());
  return n;
}

size_t SemanticCache::EvictExpired(uint32_t tenant) {
  std::lock_guard lock(mu_);
  return SweepExpired(tenants_[tenant], Clock::now());
}

SemanticCache::Stats SemanticCache::StatsOf(uint32_t tenant) const {
  std::lock_guard lock(mu_);
  Stats s;
  s.capacity = capacity_;
  auto it = tenants_.find(tenant);
  if (it == tenants_.end()) return s;
  const Tenant& t = it->second;
  s.entries = t.entries.size();
  s.blob_bytes = t.blob_bytes;
  s.hits = t.hits;
  s.misses = t.misses;
  s.evictions = t.evictions;
  s.expired = t.expired;
  return s;
}

void SemanticCache::set_capacity(uint64_t c) {
  std::lock_guard lock(mu_);
  capacity_ = c;
  for (auto& [id, t] : tenants_) {
    while (t.entries.size() > capacity_ && EvictLru(t)) {
    }
  }
}

uint64_t SemanticCache::capacity() const {
  std::lock_guard lock(mu_);
  return capacity_;
}

}  // namespace pion::store
