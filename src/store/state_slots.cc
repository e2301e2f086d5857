#include "store/state_slots.h"

#include <cstring>

namespace pion::store {

StatusOr<StateSlots::Slot*> StateSlots::Find(const TenantKey& key) {
  auto it = slots_.find(key);
  if (it == slots_.end()) return Error("no such state slot '" + key.name.substr(0, 128) + "'");
  return &it->second;
}

Status StateSlots::CheckAlloc(const TenantKey& key, uint64_t size, bool* exists) const {
  *exists = false;
  if (size == 0) return Error("slot size must be at least 1 byte");
  auto it = slots_.find(key);
  if (it == slots_.end()) return Status::Ok();
  if (it->second.size != size) {
    return Error("state slot '" + key.name.substr(0, 128) + "' exists with " +
                 std::to_string(it->second.size) + " bytes, not " + std::to_string(size) +
                 "; STATE.FREE it first");
  }
  *exists = true;
  return Status::Ok();
}

StateSlots::Slot& StateSlots::Insert(const TenantKey& key, residency::ObjectRef obj) {
  Slot& s = slots_[key];
  s.size = obj->bytes();
  s.obj = std::move(obj);
  s.incarnation = next_incarnation_++;
  bytes_ += s.size;
  PublishGauges();
  return s;
}

Status StateSlots::CheckRange(const TenantKey& key, const Slot& slot, uint64_t offset, uint64_t len,
                              std::string_view what) {
  if (offset > slot.size || len > slot.size - offset) {
    return Error(std::string(what) + " of " + std::to_string(len) + " bytes at offset " +
                 std::to_string(offset) + " exceeds slot '" + key.name.substr(0, 128) + "' of " +
                 std::to_string(slot.size) + " bytes");
  }
  return Status::Ok();
}

bool StateSlots::WriteInPlace(Slot& slot, uint64_t offset, std::string_view data,
                              uint32_t own_host_pins) {
  uint8_t* p = slot.obj->BeginWrite(0, own_host_pins);
  if (p == nullptr) return false;
  std::memcpy(p + offset, data.data(), data.size());
  slot.obj->EndWrite();
  ++slot.writes;
  return true;
}

void StateSlots::Replace(Slot& slot, residency::ObjectRef obj) {
  slot.obj = std::move(obj);  // a reply still sending the old bytes keeps them alive
  ++slot.writes;
}

bool StateSlots::Free(const TenantKey& key) {
  auto it = slots_.find(key);
  if (it == slots_.end()) return false;
  bytes_ -= it->second.size;
  slots_.erase(it);
  PublishGauges();
  return true;
}

StateSlots::Usage StateSlots::UsageOf(uint32_t tenant) const {
  Usage u;
  for (const auto& [k, v] : slots_) {
    if (k.tenant != tenant) continue;
    ++u.slots;
    u.bytes += v.size;
  }
  return u;
}

}  // namespace pion::store
