// Argument parsing helpers shared by families: each returns a Status whose message names the
// argument, what was expected and what arrived.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/bytes.h"
#include "common/status.h"

namespace pion::families {

inline bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'a' && x <= 'z') x = static_cast<char>(x - 32);
    if (y >= 'a' && y <= 'z') y = static_cast<char>(y - 32);
    if (x != y) return false;
  }
  return true;
}

// Client names (CLIENT SETNAME, HELLO SETNAME): printable ASCII without spaces, so that
// CLIENT LIST lines cannot be forged.
inline bool ValidClientName(std::string_view name) {
  for (char c : name) {
    if (c < '!' || c > '~') return false;
  }
  return true;
}
inline constexpr const char* kBadClientName =
    "ERR Client names cannot contain spaces, newlines or special characters.";

// Parses a non-negative integer argument named `what`.
inline Status ParseUint(std::string_view text, std::string_view what, uint64_t* out) {
  int64_t v = 0;
  if (!ParseInt64(text, &v) || v < 0) {
    return Error(std::string(what) + " must be a non-negative integer, got '" +
                 std::string(text.substr(0, 64)) + "'");
  }
  *out = static_cast<uint64_t>(v);
  return Status::Ok();
}

inline Status ParseInt(std::string_view text, std::string_view what, int64_t* out) {
  if (!ParseInt64(text, out)) {
    return Error(std::string(what) + " must be an integer, got '" +
                 std::string(text.substr(0, 64)) + "'");
  }
  return Status::Ok();
}

}  // namespace pion::families
