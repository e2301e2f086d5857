#include "residency/object.h"

#include <numeric>

#include "residency/engine.h"

namespace pion::residency {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

}  // namespace

Object::Object(Engine* engine, Family family, uint64_t id, std::vector<uint64_t> sizes,
               BufferAllocator* alloc)
    : engine_(engine),
      family_(family),
      id_(id),
      sizes_(std::move(sizes)),
      bytes_(std::accumulate(sizes_.begin(), sizes_.end(), uint64_t{0})),
      alloc_(alloc) {
  last_use_.store(NowNs(), std::memory_order_relaxed);
}

Object::~Object() { engine_->Forget(this); }

void Object::Touch() const { last_use_.store(NowNs(), std::memory_order_relaxed); }

uint64_t Object::generation() const {
  std::lock_guard lock(mu_);
  return generation_;
}

BufferRef Object::HostBlock(size_t i) const {
  std::shared_ptr<HostReplica> h;
  {
    std::lock_guard lock(mu_);
    h = host_;
  }
  if (!h) return nullptr;
  Touch();
  // Aliasing: the block's ref shares ownership of the whole replica (and its charge).
  return BufferRef(h, h->blocks[i].get());
}

bool Object::HostBlocks(std::vector<BufferRef>* out) const {
  std::shared_ptr<HostReplica> h;
  {
    std::lock_guard lock(mu_);
    h = host_;
  }
  if (!h) return false;
  Touch();
  out->clear();
  for (const auto& b : h->blocks) out->push_back(BufferRef(h, b.get()));
  return true;
}

GpuPin Object::Gpu() const {
  std::lock_guard lock(mu_);
  if (!gpu_) return GpuPin();
  Touch();
  return GpuPin(gpu_);  // counted as a reader before the lock is released: no demotion race
}

bool Object::Resident(Tier t) const {
  std::lock_guard lock(mu_);
  switch (t) {
    case Tier::kGpu:
      return gpu_ != nullptr;
    case Tier::kHost:
      return host_ != nullptr;
    case Tier::kDisk:
      return disk_ != nullptr;
  }
  return false;
}

unsigned Object::Tiers() const {
  std::lock_guard lock(mu_);
  return (gpu_ ? 1u << static_cast<int>(Tier::kGpu) : 0u) |
         (host_ ? 1u << static_cast<int>(Tier::kHost) : 0u) |
         (disk_ ? 1u << static_cast<int>(Tier::kDisk) : 0u);
}

bool Object::Durable() const {
  std::lock_guard lock(mu_);
  return disk_ != nullptr && disk_->durable();
}

std::string Object::lost() const {
  std::lock_guard lock(mu_);
  return lost_;
}

uint8_t* Object::BeginWrite(size_t block, uint32_t own_host_pins) {
  // Stale lower copies leave the tier lists, so the directory lock comes first.
  std::shared_ptr<GpuReplica> old_gpu;
  std::shared_ptr<DiskCopy> old_disk;
  uint8_t* p = nullptr;
  {
    std::unique_lock dir(engine_->dir_mu_, std::defer_lock);
    std::unique_lock lock(mu_);
    auto eligible = [&] {
      return host_ && host_.use_count() == 1 && host_->blocks[block].use_count() == 1 &&
             !writing_ && !moving_ && pins_[static_cast<int>(Tier::kGpu)] == 0 &&
             pins_[static_cast<int>(Tier::kHost)] == own_host_pins &&
             pins_[static_cast<int>(Tier::kDisk)] == 0 && (!gpu_ || gpu_->readers() == 0) &&
             !promoting_[0] && !promoting_[1] && !promoting_[2];
    };
    if (!eligible()) return nullptr;
    if (gpu_ || disk_) {
      lock.unlock();
      dir.lock();
      lock.lock();
      if (!eligible()) return nullptr;
      if (gpu_) {
        old_gpu = std::move(gpu_);
        engine_->UnlinkLocked(this, Tier::kGpu);
      }
      if (disk_) {
        old_disk = std::move(disk_);
        engine_->UnlinkLocked(this, Tier::kDisk);
      }
    }
    writing_ = true;
    p = host_->blocks[block]->data();
  }
  Touch();
  return p;  // the stale copies are released here, outside the locks
}

void Object::EndWrite() {
  std::lock_guard lock(mu_);
  writing_ = false;
  ++generation_;
}

bool PinSet::TryPin(const ObjectRef& obj, Tier tier) {
  {
    std::lock_guard lock(obj->mu_);
    const bool resident = tier == Tier::kGpu    ? obj->gpu_ != nullptr
                          : tier == Tier::kHost ? obj->host_ != nullptr
                                                : obj->disk_ != nullptr;
    if (!resident) return false;
    ++obj->pins_[static_cast<int>(tier)];
  }
  obj->Touch();
  pins_.emplace_back(obj, tier);
  return true;
}

std::unordered_map<const Object*, uint32_t> PinSet::Counts(Tier tier) const {
  std::unordered_map<const Object*, uint32_t> out;
  for (const auto& [o, t] : pins_) {
    if (t == tier) ++out[o.get()];
  }
  return out;
}

void PinSet::Merge(PinSet&& other) {
  for (auto& p : other.pins_) pins_.push_back(std::move(p));
  other.pins_.clear();
}

void PinSet::Reset() {
  for (auto& [obj, tier] : pins_) {
    std::lock_guard lock(obj->mu_);
    --obj->pins_[static_cast<int>(tier)];
  }
  pins_.clear();
}

}  // namespace pion::residency
