#include "store/state_slots.h"

#include <cstring>

namespace pion::store {

StatusOr<BufferRef> StateSlots::Find(const TenantKey& key) const {
  auto it = slots_.find(key);
  if (it == slots_.end()) return Error("no such state slot '" + key.name + "'");
  return it->second;
}

Status StateSlots::Alloc(const TenantKey& key, uint64_t size) {
  if (size == 0) return Error("slot size must be at least 1 byte");
  auto it = slots_.find(key);
  if (it != slots_.end()) {
    if (it->second->size() == size) return Status::Ok();
    return Error("state slot '" + key.name + "' exists with " + std::to_string(it->second->size()) +
                 " bytes, not " + std::to_string(size) + "; STATE.FREE it first");
  }
  if (budget_.reserve) {
    Status s = budget_.reserve(size);
    if (!s.ok()) return s;
  }
  auto buf = BufferAllocator::Default()->Allocate(size);
  if (!buf.ok()) {
    if (budget_.release) budget_.release(size);
    return buf.status();
  }
  std::memset(buf.value()->data(), 0, size);
  slots_.emplace(key, std::move(buf).value());
  bytes_ += size;
  PublishGauges();
  return Status::Ok();
}

Status StateSlots::Write(const TenantKey& key, uint64_t offset, std::string_view data) {
  auto buf = Find(key);
  if (!buf.ok()) return buf.status();
  uint64_t size = buf.value()->size();
  if (offset > size || data.size() > size - offset) {
    return Error("write of " + std::to_string(data.size()) + " bytes at offset " +
                 std::to_string(offset) + " exceeds slot '" + key.name + "' of " +
                 std::to_string(size) + " bytes");
  }
  // Overwrite in place: readers that still reference the buffer from an earlier READ reply
  // get their bytes copied at reply time only when small; a large READ reply shares the
  // buffer, so copy-on-write when someone else holds it.
  if (buf.value().use_count() > 2) {
    auto copy = CopyToBuffer(buf.value()->view());
    if (!copy.ok()) return copy.status();
    slots_[key] = copy.value();
    buf = copy.value();
  }
  std::memcpy(buf.value()->data() + offset, data.data(), data.size());
  return Status::Ok();
}

StatusOr<BufferRef> StateSlots::Read(const TenantKey& key, uint64_t offset, uint64_t len,
                                     const uint8_t** begin) {
  auto buf = Find(key);
  if (!buf.ok()) return buf.status();
  uint64_t size = buf.value()->size();
  if (offset > size || len > size - offset) {
    return Error("read of " + std::to_string(len) + " bytes at offset " + std::to_string(offset) +
                 " exceeds slot '" + key.name + "' of " + std::to_string(size) + " bytes");
  }
  *begin = buf.value()->data() + offset;
  return buf;
}

bool StateSlots::Free(const TenantKey& key) {
  auto it = slots_.find(key);
  if (it == slots_.end()) return false;
  uint64_t size = it->second->size();
  slots_.erase(it);
  bytes_ -= size;
  PublishGauges();
  if (budget_.release) budget_.release(size);
  return true;
}

StateSlots::Usage StateSlots::UsageOf(uint32_t tenant) const {
  Usage u;
  for (const auto& [k, v] : slots_) {
    if (k.tenant != tenant) continue;
    ++u.slots;
    u.bytes += v->size();
  }
  return u;
}

}  // namespace pion::store
