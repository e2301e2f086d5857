#include "store/saved_record.h"

#include <cstdlib>

namespace pion::store {
namespace {

std::string Hex(std::string_view s) {
  static const char* k = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(k[c >> 4]);
    out.push_back(k[c & 15]);
  }
  return out;
}

bool Unhex(std::string_view h, std::string* out) {
  if (h.size() % 2) return false;
  auto val = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  out->clear();
  for (size_t i = 0; i < h.size(); i += 2) {
    const int hi = val(h[i]), lo = val(h[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi * 16 + lo));
  }
  return true;
}

}  // namespace

StatusOr<std::string> SavedRecord::Get(const std::string& key) const {
  auto it = fields.find(key);
  if (it == fields.end()) return Status(ErrorKind::kCorrupt, kind + " manifest has no " + key);
  return it->second;
}

StatusOr<uint64_t> SavedRecord::GetUint(const std::string& key) const {
  auto v = Get(key);
  if (!v.ok()) return v.status();
  char* end = nullptr;
  const uint64_t n = std::strtoull(v->c_str(), &end, 10);
  if (v->empty() || *end != '\0') {
    return Status(ErrorKind::kCorrupt, kind + " manifest field " + key + " is not a number");
  }
  return n;
}

std::string EncodeSavedRecord(const SavedRecord& r) {
  std::string out = "pion-" + r.kind + " v1\n";
  for (const auto& [k, v] : r.fields) out += k + "=" + Hex(v) + "\n";
  return out;
}

StatusOr<SavedRecord> DecodeSavedRecord(std::string_view meta, std::string_view kind) {
  SavedRecord r;
  r.kind = std::string(kind);
  const std::string header = "pion-" + r.kind + " v1";
  size_t pos = meta.find('\n');
  if (pos == std::string_view::npos || meta.substr(0, pos) != header) {
    return Status(ErrorKind::kCorrupt, r.kind + " manifest has an unknown header");
  }
  for (++pos; pos < meta.size();) {
    size_t nl = meta.find('\n', pos);
    if (nl == std::string_view::npos) nl = meta.size();
    std::string_view line = meta.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    std::string value;
    if (eq == std::string_view::npos || !Unhex(line.substr(eq + 1), &value)) {
      return Status(ErrorKind::kCorrupt, r.kind + " manifest line is malformed");
    }
    r.fields[std::string(line.substr(0, eq))] = std::move(value);
  }
  return r;
}

std::string SavedObjectName(std::string_view kind, std::string_view tenant, std::string_view key) {
  std::string name(kind);
  name.push_back('\0');
  name.append(tenant);
  name.push_back('\0');
  name.append(key);
  return name;
}

}  // namespace pion::store
