// Users and tenants.
//
// A tenant is the unit of isolation: every key, session and namespace a family stores is
// scoped by the tenant of the connection that stored it, so two tenants using the same name
// never see each other's data. AUTH binds a connection to a user and through it to a tenant.
// Without --requirepass/--users every connection is the 'default' user of tenant 'default'.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace pion::server {

inline constexpr uint32_t kDefaultTenant = 0;

struct User {
  std::string name;
  std::string password;
  uint32_t tenant = kDefaultTenant;
};

class UserTable {
 public:
  UserTable();

  // Loads "<user> <password> <tenant>" lines ('#' comments, blank lines ignored).
  Status LoadFile(const std::string& path);
  // Sets the password of the 'default' user (tenant 'default').
  void SetDefaultPassword(const std::string& password);

  // Checks credentials; returns the user's tenant, or nullopt.
  std::optional<uint32_t> Authenticate(std::string_view user, std::string_view password) const;

  // Tenant id <-> name. Ids are dense and stable for the process lifetime.
  std::string TenantName(uint32_t id) const;
  uint32_t TenantId(std::string_view name);
  size_t user_count() const;

 private:
  mutable std::mutex mu_;  // AUTH and CONFIG only; never on the data path
  std::unordered_map<std::string, User> users_;
  std::vector<std::string> tenant_names_;
};

}  // namespace pion::server
