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
  auto& a = arenas_[tenant];
  if (a == nullptr)
    a = std::make_unique<ShmArena>("pion-tenant-" + std::to_string(tenant), segment_bytes_);
  return a.get();
}

BufferAllocator* ShmPlane::AllocatorFor(uint32_t tenant) {
  ShmArena* a = ArenaFor(tenant);
  return a != nullptr ? static_cast<BufferAllocator*>(a) : BufferAllocator::Default();
}

StatusOr<uint64_t> ShmPlane::Grant(uint64_t client, std::vector<BufferRef> held, uint64_t bytes,
                                   std::shared_ptr<void> keep) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& mine = leases_[client];
  if (mine.size() >= max_leases_) {
    return Status(ErrorKind::kBusy, "client holds " + std::to_string(mine.size()) +
                                        " leases, the --shm-max-leases limit; SHM.RELEASE some");
  }
  const uint64_t id = next_lease_++;
  mine.emplace(id, Lease{std::move(held), bytes, Clock::now() + ttl_, false, std::move(keep)});
  leased_bytes_ += bytes;
  ++lease_count_;
  ++granted_;
  return id;
}

StatusOr<ShmPlane::Reservation> ShmPlane::Reserve(uint64_t client, uint64_t bytes) {
  if (!enabled_) return Error("the shared-memory data plane is off (start with --unixsocket)");
  BufferRef buf;
  Reservation r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& mine = leases_[client];
    if (mine.size() >= max_leases_) {
      return Status(ErrorKind::kBusy, "client holds " + std::to_string(mine.size()) +
                                          " leases, the --shm-max-leases limit; SHM.RELEASE some");
    }
    auto& arena = staging_[client];
    if (!arena) {
      arena = std::make_unique<ShmArena>("pion-staging-" + std::to_string(client), segment_bytes_,
                                         /*retain_bytes=*/0);
    }
    auto b = arena->Allocate(bytes);
    if (!b.ok()) return b.status();
    buf = std::move(b).value();
    r.lease = next_lease_++;
    r.segment = buf->segment_fd();
    r.offset = buf->segment_offset();
    r.length = bytes;
    mine.emplace(r.lease, Lease{{buf}, bytes, Clock::now() + ttl_, /*write=*/true});
    leased_bytes_ += bytes;
    ++lease_count_;
    ++granted_;
  }
  return r;
}

StatusOr<uint64_t> ShmPlane::PeekSize(uint64_t client, uint64_t lease) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto c = leases_.find(client);
  auto it = c == leases_.end() ? decltype(c->second.end()){} : c->second.find(lease);
  if (c == leases_.end() || it == c->second.end() || !it->second.write) {
    return Error("no SHM.RESERVE lease " + std::to_string(lease) +
                 " on this connection (never reserved here, already committed, released or "
                 "expired)");
  }
  return static_cast<uint64_t>(it->second.held.front()->size());
}

StatusOr<BufferRef> ShmPlane::Take(uint64_t client, uint64_t lease) {
  std::lock_guard<std::mutex> lock(mu_);
  auto c = leases_.find(client);
  auto it = c == leases_.end() ? decltype(c->second.end()){} : c->second.find(lease);
  if (c == leases_.end() || it == c->second.end() || !it->second.write) {
    return Error("no SHM.RESERVE lease " + std::to_string(lease) +
                 " on this connection (never reserved here, already committed, released or "
                 "expired)");
  }
  BufferRef buf = it->second.held.front();
  leased_bytes_ -= it->second.bytes;
  --lease_count_;
  ++released_;
  c->second.erase(it);
  if (c->second.empty()) leases_.erase(c);
  return buf;
}

void ShmPlane::RetireStaging(uint64_t client) {
  auto it = staging_.find(client);
  if (it == staging_.end()) return;
  retired_.push_back(std::move(it->second));
  staging_.erase(it);
}

void ShmPlane::SweepRetired() {
  // Deleted only when no region is alive (a commit may still be reading one).
  for (auto it = retired_.begin(); it != retired_.end();) {
    it = (*it)->used_bytes() == 0 ? retired_.erase(it) : std::next(it);
  }
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
    RetireStaging(client);
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
  const size_t n = gone.size();
  gone.clear();  // buffers back to their arenas, then delete retired staging arenas
  std::lock_guard<std::mutex> lock(mu_);
  SweepRetired();
  return n;
}

void ShmPlane::Clear() {
  std::unordered_map<uint64_t, std::map<uint64_t, Lease>> leases;
  std::unordered_map<uint64_t, std::unique_ptr<ShmArena>> staging;
  std::vector<std::unique_ptr<ShmArena>> retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    leases.swap(leases_);
    staging.swap(staging_);
    retired.swap(retired_);
    leased_bytes_ = 0;
    lease_count_ = 0;
  }
  leases.clear();  // before the staging arenas their write leases' regions come from
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
