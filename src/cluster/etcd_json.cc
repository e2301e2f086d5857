#include "cluster/etcd_json.h"

#include <openssl/evp.h>

#include <charconv>

namespace pion::cluster::etcd_json {

StatusOr<Json> Parse(std::string_view text) {
  Json j = Json::parse(text.begin(), text.end(), /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return Error("etcd sent a reply that is not JSON: '" + std::string(text.substr(0, 200)) + "'");
  }
  return j;
}

const Json& Member(const Json& j, std::string_view name) {
  static const Json kAbsent;
  if (!j.is_object()) return kAbsent;
  const auto it = j.find(name);
  return it == j.end() ? kAbsent : *it;
}

int64_t Int(const Json& j, std::string_view name, int64_t fallback) {
  const Json& v = Member(j, name);
  if (v.is_number_integer()) return v.get<int64_t>();
  if (!v.is_string()) return fallback;
  const std::string& s = v.get_ref<const std::string&>();
  int64_t out = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && end == s.data() + s.size() && !s.empty() ? out : fallback;
}

std::string Text(const Json& j, std::string_view name) {
  const Json& v = Member(j, name);
  return v.is_string() ? v.get<std::string>() : std::string();
}

bool Bool(const Json& j, std::string_view name) {
  const Json& v = Member(j, name);
  return v.is_boolean() && v.get<bool>();
}

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

std::string Base64Encode(std::string_view bytes) {
  std::string out((bytes.size() + 2) / 3 * 4 + 1, '\0');  // EVP_EncodeBlock writes a NUL
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()),
                                static_cast<int>(bytes.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

StatusOr<std::string> Base64Decode(std::string_view text) {
  if (text.size() % 4 != 0) {
    return Error("base64 text of " + std::to_string(text.size()) +
                 " characters, expected a multiple of 4");
  }
  size_t pad = 0;
  while (pad < 2 && pad < text.size() && text[text.size() - 1 - pad] == '=') ++pad;
  // EVP_DecodeBlock takes '=' anywhere as zero bits and skips surrounding whitespace: only the
  // standard alphabet before the padding reaches it.
  static constexpr std::string_view kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const size_t bad = text.substr(0, text.size() - pad).find_first_not_of(kAlphabet);
  if (bad != std::string_view::npos) {
    return Error("base64 character out of the alphabet at offset " + std::to_string(bad));
  }
  std::string out(text.size() / 4 * 3, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(text.data()),
                                static_cast<int>(text.size()));
  if (n < 0 || static_cast<size_t>(n) < pad) return Error("base64 text does not decode");
  out.resize(static_cast<size_t>(n) - pad);  // it counts the padding as decoded zero bytes
  return out;
}

bool MessageStream::Feed(std::string_view piece,
                         const std::function<bool(std::string_view)>& on_message) {
  partial_.append(piece);
  size_t start = 0;
  bool go_on = true;
  for (size_t nl; go_on && (nl = partial_.find('\n', start)) != std::string::npos;) {
    std::string_view message(partial_.data() + start, nl - start);
    start = nl + 1;
    if (!message.empty() && message.back() == '\r') message.remove_suffix(1);
    if (!message.empty()) go_on = on_message(message);
  }
  partial_.erase(0, start);
  return go_on;
}

}  // namespace pion::cluster::etcd_json
