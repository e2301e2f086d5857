// TenantKey: a key scoped by tenant. Every store keys its objects this way, so the same name
// used by two tenants names two different objects.
#pragma once

#include <xxhash.h>

#include <compare>
#include <cstdint>
#include <string>
#include <string_view>

namespace pion::store {

struct TenantKey {
  uint32_t tenant;
  std::string name;
  bool operator==(const TenantKey&) const = default;
  auto operator<=>(const TenantKey&) const = default;
};

struct TenantKeyHash {
  size_t operator()(const TenantKey& k) const {
    return static_cast<size_t>(XXH3_64bits_withSeed(k.name.data(), k.name.size(), k.tenant));
  }
};

}  // namespace pion::store
