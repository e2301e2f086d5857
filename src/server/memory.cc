#include "server/memory.h"

#include <algorithm>

#include "common/bytes.h"

namespace pion::server {

std::string_view MemFamilyName(MemFamily f) {
  switch (f) {
    case MemFamily::kState:
      return "state";
    case MemFamily::kSsm:
      return "ssm";
    case MemFamily::kVStore:
      return "vstore";
    case MemFamily::kAttention:
      return "attention";
    case MemFamily::kIndex:
      return "index";
    case MemFamily::kCount:
      break;
  }
  return "other";
}

uint64_t MemoryAccountant::free_bytes() const {
  uint64_t max = maxmemory(), u = used();
  if (max == 0) return UINT64_MAX;
  return u >= max ? 0 : max - u;
}

uint64_t MemoryAccountant::Headroom(MemFamily f) const {
  uint64_t h = free_bytes();
  const uint64_t cap = family_limit(f), fu = used(f);
  if (cap != 0) h = std::min(h, fu >= cap ? 0 : cap - fu);
  return h;
}

bool MemoryAccountant::TryAdd(MemFamily f, uint64_t bytes) {
  auto& fam = by_family_[static_cast<int>(f)];
  const uint64_t cap = family_limit(f);
  if (cap != 0) {
    // Claim the family's share first, then the total; undo the first if the second fails.
    uint64_t cur = fam.load(std::memory_order_relaxed);
    do {
      if (cur + bytes > cap || cur + bytes < cur) return false;
    } while (!fam.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
  }
  uint64_t max = maxmemory();
  uint64_t cur = used_.load(std::memory_order_relaxed);
  do {
    if (max != 0 && (cur + bytes > max || cur + bytes < cur)) {
      if (cap != 0) fam.fetch_sub(bytes, std::memory_order_relaxed);
      return false;
    }
  } while (!used_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
  if (cap == 0) fam.fetch_add(bytes, std::memory_order_relaxed);
  return true;
}

Status MemoryAccountant::Reserve(MemFamily f, uint64_t bytes) {
  if (TryAdd(f, bytes)) return Status::Ok();
  const auto& reclaim = reclaimers_[static_cast<int>(f)];
  const uint64_t cap = family_limit(f);
  if (reclaim) {
    uint64_t max = maxmemory(), u = used();
    const uint64_t need_total = (max != 0 && u + bytes > max) ? u + bytes - max : 0;
    uint64_t need = need_total;
    const uint64_t fu = used(f);
    const bool family_binds = cap != 0 && fu + bytes > cap;
    if (family_binds) need = std::max(need, fu + bytes - cap);
    if (need == 0) need = bytes;
    reclaim(need, family_binds && need_total == 0);
    if (TryAdd(f, bytes)) return Status::Ok();
  }
  oom_rejections_.fetch_add(1, std::memory_order_relaxed);
  if (cap != 0 && used(f) + bytes > cap) {
    const uint64_t fu = used(f);
    return Status(ErrorKind::kOom,
                  std::string(MemFamilyName(f)) + " write of " + std::to_string(bytes) +
                      " bytes does not fit: " + std::to_string(fu < cap ? cap - fu : 0) +
                      " bytes free of the " + std::string(MemFamilyName(f)) + " limit " +
                      std::to_string(cap) + " (" + HumanBytes(cap) + ")");
  }
  uint64_t free = free_bytes();
  return Status(ErrorKind::kOom, "command not allowed when used memory > 'maxmemory': " +
                                     std::string(MemFamilyName(f)) + " write of " +
                                     std::to_string(bytes) + " bytes, " + std::to_string(free) +
                                     " bytes free of maxmemory " + std::to_string(maxmemory()) +
                                     " (" + HumanBytes(maxmemory()) + ")");
}

void MemoryAccountant::Charge(MemFamily f, uint64_t bytes) {
  used_.fetch_add(bytes, std::memory_order_relaxed);
  by_family_[static_cast<int>(f)].fetch_add(bytes, std::memory_order_relaxed);
}

void MemoryAccountant::Release(MemFamily f, uint64_t bytes) {
  used_.fetch_sub(bytes, std::memory_order_relaxed);
  by_family_[static_cast<int>(f)].fetch_sub(bytes, std::memory_order_relaxed);
}

}  // namespace pion::server
