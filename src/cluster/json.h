// The small piece of JSON the etcd v3 gateway speaks: a reader into a tree of values (numbers
// kept as their text: etcd writes int64 fields as strings or numbers), a string escaper for
// requests, and base64 (etcd's keys and values travel base64-encoded). Not a general library.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pion::cluster {

struct Json {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  std::string text;  // kString: the decoded string; kNumber: the number as written
  std::vector<Json> items;
  std::map<std::string, Json, std::less<>> fields;

  // The member `name` of an object, or a null value when absent (or not an object).
  const Json& operator[](std::string_view name) const;
  // kString or kNumber as an int64 (etcd writes int64 as "123"); `fallback` otherwise.
  int64_t Int(int64_t fallback = 0) const;
  bool is_null() const { return type == Type::kNull; }
};

// Parses one JSON document (surrounding whitespace allowed). kError names the offset.
StatusOr<Json> ParseJson(std::string_view text);

// `s` as a JSON string literal, quotes included.
std::string JsonQuote(std::string_view s);

std::string Base64Encode(std::string_view bytes);
// kError on a character outside the standard alphabet or a bad length.
StatusOr<std::string> Base64Decode(std::string_view text);

}  // namespace pion::cluster
