// What etcd's v3 JSON gateway sends and takes, read and written with nlohmann-json (Debian's
// nlohmann-json3-dev): int64 fields arrive as strings ("12") or numbers and are absent when zero,
// keys and values travel base64-encoded (OpenSSL's EVP_EncodeBlock / EVP_DecodeBlock, which the
// process already loads through libcurl), and a stream (/v3/watch) is newline-delimited JSON
// messages that arrive cut at arbitrary points. Apart from etcd_client so the unit tests reach it
// without etcd. Nothing here throws.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "common/status.h"

namespace pion::cluster::etcd_json {

using Json = nlohmann::json;

// Parses one JSON document. kErr naming what is wrong when it does not parse.
StatusOr<Json> Parse(std::string_view text);

// The member `name` of an object; a null value when absent or when `j` is no object.
const Json& Member(const Json& j, std::string_view name);
// An int64 member, written as "12" or 12; `fallback` when absent or not a decimal integer.
int64_t Int(const Json& j, std::string_view name, int64_t fallback = 0);
// A string member; empty when absent or not a string.
std::string Text(const Json& j, std::string_view name);
// A boolean member; false when absent (etcd omits false) or not a boolean.
bool Bool(const Json& j, std::string_view name);

// `j` as compact JSON text.
std::string Dump(const Json& j);

std::string Base64Encode(std::string_view bytes);
// kErr on a length that is not a multiple of 4, a character outside the standard alphabet, or
// padding anywhere but the last one or two characters.
StatusOr<std::string> Base64Decode(std::string_view text);

// Splits a stream of newline-delimited messages that arrives in pieces cut anywhere.
class MessageStream {
 public:
  // Appends `piece` and calls `on_message` with each message it completes, in order, until one
  // returns false (then Feed returns false and keeps the rest unread).
  bool Feed(std::string_view piece, const std::function<bool(std::string_view)>& on_message);
  // Bytes received after the last complete message.
  size_t pending() const { return partial_.size(); }

 private:
  std::string partial_;
};

}  // namespace pion::cluster::etcd_json
