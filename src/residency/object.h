// Object: the unit of residency — one family object's bytes (a V-store chunk, an SSM layer
// blob, a STATE slot, an attention slot's K and V), as a fixed list of blocks, with its replicas
// by tier (GPU, host, disk), generation, pins and LRU position. The engine (engine.h) owns the
// directory of objects and moves replicas; families hold ObjectRefs and read through them.
//
// Contract (seed 004 §0x04A–0x04C):
//   - A replica is visible only once complete and validated (reserve -> copy -> validate ->
//     publish); readers see the old replica or the new one, never a half-copied one.
//   - What a reader took stays valid: a host block ref keeps that host replica alive (and
//     charged), a GpuPin keeps the GPU replica from being demoted, a disk copy stays readable
//     while any transfer uses it.
//   - Content changes only through BeginWrite/EndWrite, which is allowed only when nobody else
//     holds the bytes and no transfer is in flight; it drops the lower replicas (they would be
//     stale) and moves the generation on, so a completion fenced on the old generation is
//     discarded (no ABA). Otherwise a family copies on write into a new object.
//   - The last copy is never dropped before another tier holds a validated one.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/buffer.h"
#include "common/byte_budget.h"
#include "residency/disk_file.h"
#include "residency/gpu_replica.h"
#include "residency/tier.h"

namespace pion::residency {

class Engine;
struct Transfer;

// An object's bytes in host memory: one buffer per block, charged to the family's host budget
// while anyone holds it (a reply referencing one block holds the whole replica).
struct HostReplica {
  std::vector<BufferRef> blocks;
  std::unique_ptr<Charge> charge;
};

class Object : public std::enable_shared_from_this<Object> {
 public:
  ~Object();
  Object(const Object&) = delete;
  Object& operator=(const Object&) = delete;

  Family family() const { return family_; }
  uint64_t id() const { return id_; }  // unique per object, never reused
  size_t block_count() const { return sizes_.size(); }
  uint64_t block_size(size_t i) const { return sizes_[i]; }
  uint64_t bytes() const { return bytes_; }
  uint64_t generation() const;

  // ---- Readers (any thread) ----------------------------------------------------------------
  // Block i's host bytes, or null when the object is not host-resident. The ref keeps the host
  // replica alive and charged for as long as it is held. Marks the object used.
  BufferRef HostBlock(size_t i) const;
  // Every host block (false, and `out` untouched, when not host-resident). Marks it used.
  bool HostBlocks(std::vector<BufferRef>* out) const;
  // A pin on the GPU replica, or an empty pin. Marks it used.
  GpuPin Gpu() const;
  bool Resident(Tier t) const;
  // Bit (1 << tier) for every tier holding a valid replica now.
  unsigned Tiers() const;
  // A saved (durable) copy of this generation exists.
  bool Durable() const;
  // Why the bytes are gone (the only copy failed validation), or "" when they are not.
  std::string lost() const;
  // A counter the engine bumps if this object is ever lost: how a container of many objects (a
  // V-store session) learns in O(1) that one of them is gone. Set before the object is shared.
  void set_loss_counter(std::shared_ptr<std::atomic<uint64_t>> c) { loss_counter_ = std::move(c); }

  // ---- Writing in place (the owning shard) --------------------------------------------------
  // Block i's host bytes to change in place, or null when the bytes are shared (a reply, a
  // save, a transfer), pinned by another request (a reader on another thread), or not
  // host-resident: the caller copies on write instead. `own_host_pins`: the host pins the
  // caller itself holds on this object (a writer keeps what it writes in memory by pinning it,
  // as a reader does); only pins beyond those forbid it. Drops the now-stale GPU and disk
  // replicas. EndWrite() must follow.
  uint8_t* BeginWrite(size_t block, uint32_t own_host_pins = 0);
  void EndWrite();

 private:
  friend class Engine;
  friend class PinSet;
  Object(Engine* engine, Family family, uint64_t id, std::vector<uint64_t> sizes,
         BufferAllocator* alloc);
  void Touch() const;

  struct Link {  // guarded by Engine::dir_mu_
    Object* prev = nullptr;
    Object* next = nullptr;
    bool linked = false;
    int64_t stamp = 0;  // last_use_ when it was (re)placed at the head
  };

  Engine* const engine_;
  const Family family_;
  const uint64_t id_;
  const std::vector<uint64_t> sizes_;
  const uint64_t bytes_;
  BufferAllocator* const alloc_;  // where promoted host blocks are allocated

  mutable std::mutex mu_;  // after Engine::dir_mu_ when both are held
  uint64_t generation_ = 1;
  std::shared_ptr<HostReplica> host_;
  std::shared_ptr<GpuReplica> gpu_;
  std::shared_ptr<DiskCopy> disk_;
  std::string lost_;
  uint32_t pins_[kTierCount] = {};
  bool writing_ = false;
  bool moving_ = false;  // a demotion is copying the bytes down
  std::shared_ptr<Transfer> promoting_[kTierCount];
  mutable std::atomic<int64_t> last_use_{0};
  std::shared_ptr<std::atomic<uint64_t>> loss_counter_;
  Link links_[kTierCount];
};

using ObjectRef = std::shared_ptr<Object>;

// Objects pinned in a tier (not demoted out of it) until the set is destroyed or Reset().
class PinSet {
 public:
  PinSet() = default;
  PinSet(PinSet&&) noexcept = default;
  PinSet& operator=(PinSet&& o) noexcept {
    if (this != &o) {
      Reset();
      pins_ = std::move(o.pins_);
    }
    return *this;
  }
  PinSet(const PinSet&) = delete;
  PinSet& operator=(const PinSet&) = delete;
  ~PinSet() { Reset(); }

  // Pins obj in tier if it is resident there; false (nothing pinned) otherwise.
  bool TryPin(const ObjectRef& obj, Tier tier);
  // Each object this set pins in `tier`, with how many pins it holds on it.
  std::unordered_map<const Object*, uint32_t> Counts(Tier tier) const;
  void Merge(PinSet&& other);
  void Reset();
  size_t size() const { return pins_.size(); }

 private:
  friend class Engine;
  void Adopt(ObjectRef obj, Tier tier) { pins_.emplace_back(std::move(obj), tier); }
  std::vector<std::pair<ObjectRef, Tier>> pins_;
};

}  // namespace pion::residency
