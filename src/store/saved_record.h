// SavedRecord: the manifest of a family's durable object file (store/disk/object_file.h) —
// SSM.PREFIX sessions, STATE slots, ATTEND.PREFIX slots. A header line naming the kind
// ("pion-ssm v1"), then key=value lines with hex-escaped values (names may hold any byte), so
// a person can read it and any field survives. The file's blocks hold the object's bytes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "common/status.h"

namespace pion::store {

struct SavedRecord {
  std::string kind;  // "ssm", "state", "attention"
  std::map<std::string, std::string> fields;

  void Set(const std::string& key, std::string value) { fields[key] = std::move(value); }
  void SetUint(const std::string& key, uint64_t v) { fields[key] = std::to_string(v); }
  // kCorrupt naming the key when absent or malformed.
  StatusOr<std::string> Get(const std::string& key) const;
  StatusOr<uint64_t> GetUint(const std::string& key) const;
};

std::string EncodeSavedRecord(const SavedRecord& r);
// kCorrupt when the header is not "pion-<kind> v1" or a line is malformed.
StatusOr<SavedRecord> DecodeSavedRecord(std::string_view meta, std::string_view kind);

// The object name of a family object: "<kind>\0<tenant>\0<key>" (any bytes).
std::string SavedObjectName(std::string_view kind, std::string_view tenant, std::string_view key);

}  // namespace pion::store
