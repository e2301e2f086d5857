#include "server/shm_plane.h"

#include <string>

namespace pion::server {

ShmPlane::ShmPlane(bool enabled, size_t segment_bytes, int64_t lease_ttl_ms, size_t max_leases)
    : enabled_(enabled),
      segment_bytes_(segment_bytes),
      ttl_(lease_ttl_ms),
      max_leases_(max_leases) {}

ShmArena* ShmPlane::ArenaFor(uint32_t tenant) {
  if (!enabled_) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  ShmArena*& a = arenas_[tenant];
  if (a == nullptr) a = new ShmArena("pion-tenant-" + std::to_string(tenant), segment_bytes_);
  return a;
}

BufferAllocator* ShmPlane::AllocatorFor(uint32_t tenant) {
  ShmArena* a = ArenaFor(tenant);
  return a != nullptr ? static_cast<BufferAllocator*>(a) : BufferAllocator::Default();
}

StatusOr<uint64_t> ShmPlane::Grant(uint64_t client, std::vector<BufferRef> held, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& mine = leases_[client];
  if (mine.size() >= max_leases_) {
    return Status(ErrorKind::kBusy, "client holds " + std::to_string(mine.size()) +
                                        " leases, the --shm-max-leases limit; SHM.RELEASE some");
  }
  const uint64_t id = next_lease_++;
  mine.emplace(id, Lease{std::move(held), bytes, Clock::now() + ttl_});
  leased_bytes_ += bytes;
  ++lease_count_;
  ++granted_;
  return id;
}

bool ShmPlane::Release(uint64_t client, uint64_t lease) {
  Lease gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto c = leases_.find(client);
    if (c == leases_.end()) return false;
    auto it = c->second.find(lease);
    if (it == c->second.end()) return false;
    gone = std::move(it->second);
    c->second.erase(it);
    if (c->second.empty()) leases_.erase(c);
    leased_bytes_ -= gone.bytes;
    --lease_count_;
    ++released_;
  }
  return true;  // `gone` drops its buffers outside the lock
}

size_t ShmPlane::ReleaseClient(uint64_t client) {
  std::map<uint64_t, Lease> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto c = leases_.find(client);
    if (c == leases_.end()) return 0;
    gone = std::move(c->second);
    leases_.erase(c);
    for (const auto& [id, l] : gone) leased_bytes_ -= l.bytes;
    lease_count_ -= gone.size();
    released_ += gone.size();
  }
  return gone.size();
}

size_t ShmPlane::Expire(Clock::time_point now) {
  std::vector<Lease> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto c = leases_.begin(); c != leases_.end();) {
      for (auto it = c->second.begin(); it != c->second.end();) {
        if (it->second.expires > now) {
          ++it;
          continue;
        }
        leased_bytes_ -= it->second.bytes;
        gone.push_back(std::move(it->second));
        it = c->second.erase(it);
      }
      c = c->second.empty() ? leases_.erase(c) : std::next(c);
    }
    lease_count_ -= gone.size();
    expired_ += gone.size();
  }
  return gone.size();
}

ShmPlane::Stats ShmPlane::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s;
  s.arenas = arenas_.size();
  for (const auto& [t, a] : arenas_) {
    s.segment_bytes += a->segment_bytes();
    s.used_bytes += a->used_bytes();
  }
  s.leases = lease_count_;
  s.leased_bytes = leased_bytes_;
  s.granted = granted_;
  s.released = released_;
  s.expired = expired_;
  return s;
}

size_t ShmPlane::LeasesOf(uint64_t client) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto c = leases_.find(client);
  return c == leases_.end() ? 0 : c->second.size();
}

}  // namespace pion::server
