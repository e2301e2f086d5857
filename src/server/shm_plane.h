// ShmPlane: the same-host data plane (issue 7). With --unixsocket, every tenant's V-store chunks
// live in that tenant's ShmArena (memfd segments). A client on the Unix socket receives the
// segments' file descriptors once (SHM.ATTACH, SCM_RIGHTS), maps them read-only, and then asks
// for mappings instead of bytes (V.FETCH … SHM): the reply names (segment, offset, length)
// pieces and a lease.
//
// A lease holds references to the pieces' buffers. While it is held, the bytes it names cannot
// change (the stores copy-on-write a buffer that anyone else references) and cannot be reused
// (a region returns to its arena only when its last reference is gone) — so a reader never sees
// a torn mix or another value's bytes (the ABA of seed 004 §0x04C cannot happen). Leases end on
// SHM.RELEASE, when the client's connection closes, or after --shm-lease-ttl-ms. Lease ids are
// never reused. Thread-safe (one mutex; buffers are released outside it).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/buffer.h"
#include "common/shm_arena.h"
#include "common/status.h"

namespace pion::server {

class ShmPlane {
 public:
  using Clock = std::chrono::steady_clock;

  ShmPlane(bool enabled, size_t segment_bytes, int64_t lease_ttl_ms, size_t max_leases);

  bool enabled() const { return enabled_; }
  // The allocator for a tenant's stored values: its arena when enabled, the heap otherwise.
  BufferAllocator* AllocatorFor(uint32_t tenant);
  // The tenant's arena (created on first use). Null when disabled.
  ShmArena* ArenaFor(uint32_t tenant);

  // Grants a lease on `held` to client (and keeps `keep` alive as long: e.g. a GPU copy's pin
  // for ATTEND.PREFIX.EXPORT). kBusy past --shm-max-leases for that client.
  StatusOr<uint64_t> Grant(uint64_t client, std::vector<BufferRef> held, uint64_t bytes,
                           std::shared_ptr<void> keep = nullptr);
  std::chrono::milliseconds lease_ttl() const { return ttl_; }

  // Writes (reserve → the client writes → commit): a region of `bytes` in the client's own
  // staging arena — a writable mapping only that connection ever gets, so a client can never
  // write into stored values — under a write lease. Take() hands the region to the command that
  // commits it (one shot); the lease ends there.
  struct Reservation {
    uint64_t lease = 0;
    int segment = -1;  // id, and the fd to pass (writable)
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  StatusOr<Reservation> Reserve(uint64_t client, uint64_t bytes);
  StatusOr<BufferRef> Take(uint64_t client, uint64_t lease);
  // The size of a write lease's region without taking it (a commit that must wait for room
  // first); kErr as Take when there is no such lease.
  StatusOr<uint64_t> PeekSize(uint64_t client, uint64_t lease) const;
  bool Release(uint64_t client, uint64_t lease);
  size_t ReleaseClient(uint64_t client);
  size_t Expire(Clock::time_point now);
  // Ends every lease and deletes the staging arenas (the server's teardown, first: what leases
  // hold — GPU pins, the engine's replicas — is released while the engine still exists).
  void Clear();

  struct Stats {
    uint64_t arenas = 0;
    uint64_t segment_bytes = 0;
    uint64_t used_bytes = 0;
    uint64_t leases = 0;
    uint64_t leased_bytes = 0;
    uint64_t granted = 0;
    uint64_t released = 0;
    uint64_t expired = 0;
  };
  Stats stats() const;
  size_t LeasesOf(uint64_t client) const;

 private:
  struct Lease {
    std::vector<BufferRef> held;
    uint64_t bytes = 0;
    Clock::time_point expires;
    bool write = false;  // a SHM.RESERVE region, taken by its commit
    std::shared_ptr<void> keep;
  };
  void RetireStaging(uint64_t client);  // mu_ held
  void SweepRetired();                  // mu_ held

  const bool enabled_;
  const size_t segment_bytes_;
  const std::chrono::milliseconds ttl_;
  const size_t max_leases_;
  mutable std::mutex mu_;
  // The tenants' arenas. Stored buffers (the engine's replicas, the shards' stores) free
  // their regions into them, so the Server destroys this plane after all of those.
  std::unordered_map<uint32_t, std::unique_ptr<ShmArena>> arenas_;
  std::unordered_map<uint64_t, std::map<uint64_t, Lease>> leases_;  // client -> id -> lease
  // Per-client write staging; a closed client's arena is deleted once no region of it is alive.
  std::unordered_map<uint64_t, std::unique_ptr<ShmArena>> staging_;
  std::vector<std::unique_ptr<ShmArena>> retired_;
  uint64_t next_lease_ = 1;
  uint64_t leased_bytes_ = 0;
  uint64_t lease_count_ = 0;
  uint64_t granted_ = 0, released_ = 0, expired_ = 0;
};

}  // namespace pion::server
