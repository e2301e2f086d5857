#include "server/auth.h"

#include <fstream>
#include <sstream>

namespace pion::server {
namespace {

// Constant-time comparison so response timing does not leak password prefixes.
bool SecureEqual(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  size_t n = a.size() < b.size() ? a.size() : b.size();
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

UserTable::UserTable() { tenant_names_.push_back("default"); }

uint32_t UserTable::TenantId(std::string_view name) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < tenant_names_.size(); ++i) {
    if (tenant_names_[i] == name) return static_cast<uint32_t>(i);
  }
  tenant_names_.emplace_back(name);
  return static_cast<uint32_t>(tenant_names_.size() - 1);
}

std::string UserTable::TenantName(uint32_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return id < tenant_names_.size() ? tenant_names_[id] : "?";
}

size_t UserTable::user_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return users_.size();
}

Status UserTable::LoadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Error("cannot open users file " + path);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    auto hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::istringstream fields(line);
    std::string user, password, tenant, extra;
    if (!(fields >> user)) continue;
    if (!(fields >> password >> tenant) || (fields >> extra)) {
      return Error("users file " + path + " line " + std::to_string(lineno) +
                   ": expected '<user> <password> <tenant>'");
    }
    uint32_t tid = TenantId(tenant);
    std::lock_guard<std::mutex> lock(mu_);
    if (users_.count(user)) {
      return Error("users file " + path + " line " + std::to_string(lineno) + ": user '" + user +
                   "' defined twice");
    }
    users_[user] = User{user, password, tid};
  }
  return Status::Ok();
}

void UserTable::SetDefaultPassword(const std::string& password) {
  std::lock_guard<std::mutex> lock(mu_);
  users_["default"] = User{"default", password, kDefaultTenant};
}

std::optional<uint32_t> UserTable::Authenticate(std::string_view user,
                                                std::string_view password) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = users_.find(std::string(user));
  if (it == users_.end()) return std::nullopt;
  if (!SecureEqual(it->second.password, password)) return std::nullopt;
  return it->second.tenant;
}

}  // namespace pion::server
