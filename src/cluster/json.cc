#include "cluster/json.h"

#include <cstdlib>

namespace pion::cluster {
namespace {

const Json kNullJson;

class Reader {
 public:
  explicit Reader(std::string_view t) : t_(t) {}

  Status Value(Json* out, int depth) {
    if (depth > 64) return Fail("nesting deeper than 64");
    Skip();
    if (p_ >= t_.size()) return Fail("unexpected end");
    const char c = t_[p_];
    if (c == '{') return Object(out, depth);
    if (c == '[') return Array(out, depth);
    if (c == '"') {
      out->type = Json::Type::kString;
      return String(&out->text);
    }
    if (Literal("true")) {
      out->type = Json::Type::kBool;
      out->boolean = true;
      return Status::Ok();
    }
    if (Literal("false")) {
      out->type = Json::Type::kBool;
      return Status::Ok();
    }
    if (Literal("null")) return Status::Ok();
    if (c == '-' || (c >= '0' && c <= '9')) {
      const size_t start = p_++;
      while (p_ < t_.size() && (std::isdigit(static_cast<unsigned char>(t_[p_])) || t_[p_] == '.' ||
                                t_[p_] == 'e' || t_[p_] == 'E' || t_[p_] == '+' || t_[p_] == '-')) {
        ++p_;
      }
      out->type = Json::Type::kNumber;
      out->text = std::string(t_.substr(start, p_ - start));
      return Status::Ok();
    }
    return Fail(std::string("unexpected character '") + c + "'");
  }

  Status End() {
    Skip();
    return p_ == t_.size() ? Status::Ok() : Fail("trailing bytes");
  }

 private:
  Status Fail(const std::string& what) const {
    return Error("JSON: " + what + " at offset " + std::to_string(p_));
  }
  void Skip() {
    while (p_ < t_.size() && (t_[p_] == ' ' || t_[p_] == '\n' || t_[p_] == '\r' || t_[p_] == '\t'))
      ++p_;
  }
  bool Literal(std::string_view w) {
    if (t_.substr(p_, w.size()) != w) return false;
    p_ += w.size();
    return true;
  }
  Status Object(Json* out, int depth) {
    out->type = Json::Type::kObject;
    ++p_;
    Skip();
    if (p_ < t_.size() && t_[p_] == '}') {
      ++p_;
      return Status::Ok();
    }
    for (;;) {
      Skip();
      if (p_ >= t_.size() || t_[p_] != '"') return Fail("expected a member name");
      std::string name;
      Status s = String(&name);
      if (!s.ok()) return s;
      Skip();
      if (p_ >= t_.size() || t_[p_] != ':') return Fail("expected ':'");
      ++p_;
      Json v;
      s = Value(&v, depth + 1);
      if (!s.ok()) return s;
      out->fields[name] = std::move(v);
      Skip();
      if (p_ < t_.size() && t_[p_] == ',') {
        ++p_;
        continue;
      }
      if (p_ < t_.size() && t_[p_] == '}') {
        ++p_;
        return Status::Ok();
      }
      return Fail("expected ',' or '}'");
    }
  }
  Status Array(Json* out, int depth) {
    out->type = Json::Type::kArray;
    ++p_;
    Skip();
    if (p_ < t_.size() && t_[p_] == ']') {
      ++p_;
      return Status::Ok();
    }
    for (;;) {
      Json v;
      Status s = Value(&v, depth + 1);
      if (!s.ok()) return s;
      out->items.push_back(std::move(v));
      Skip();
      if (p_ < t_.size() && t_[p_] == ',') {
        ++p_;
        continue;
      }
      if (p_ < t_.size() && t_[p_] == ']') {
        ++p_;
        return Status::Ok();
      }
      return Fail("expected ',' or ']'");
    }
  }
  Status String(std::string* out) {
    ++p_;  // the opening quote
    while (p_ < t_.size()) {
      const char c = t_[p_++];
      if (c == '"') return Status::Ok();
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (p_ >= t_.size()) break;
      const char e = t_[p_++];
      switch (e) {
        case '"':
          out->push_back('"');
          break;
        case '\\':
          out->push_back('\\');
          break;
        case '/':
          out->push_back('/');
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          if (p_ + 4 > t_.size()) return Fail("short \\u escape");
          const unsigned long cp = std::strtoul(std::string(t_.substr(p_, 4)).c_str(), nullptr, 16);
          p_ += 4;
          // etcd escapes only ASCII this way (its payloads are base64); encode as UTF-8.
          if (cp < 0x80) {
            out->push_back(static_cast<char>(cp));
          } else if (cp < 0x800) {
            out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
            out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
          } else {
            out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
            out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
            out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
          }
          break;
        }
        default:
          return Fail(std::string("bad escape '\\") + e + "'");
      }
    }
    return Fail("unterminated string");
  }

  std::string_view t_;
  size_t p_ = 0;
};

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int Sextet(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

}  // namespace

const Json& Json::operator[](std::string_view name) const {
  if (type != Type::kObject) return kNullJson;
  auto it = fields.find(name);
  return it == fields.end() ? kNullJson : it->second;
}

int64_t Json::Int(int64_t fallback) const {
  if (type != Type::kString && type != Type::kNumber) return fallback;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  return (text.empty() || *end != '\0') ? fallback : v;
}

StatusOr<Json> ParseJson(std::string_view text) {
  Reader r(text);
  Json out;
  Status s = r.Value(&out, 0);
  if (s.ok()) s = r.End();
  if (!s.ok()) return s;
  return out;
}

std::string JsonQuote(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c < 0x20) {
      static const char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  out.push_back('"');
  return out;
}

std::string Base64Encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = (uint32_t{static_cast<unsigned char>(bytes[i])} << 16) |
                       (uint32_t{static_cast<unsigned char>(bytes[i + 1])} << 8) |
                       static_cast<unsigned char>(bytes[i + 2]);
    out.push_back(kAlphabet[v >> 18]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.push_back(kAlphabet[(v >> 6) & 63]);
    out.push_back(kAlphabet[v & 63]);
  }
  const size_t rest = bytes.size() - i;
  if (rest > 0) {
    uint32_t v = uint32_t{static_cast<unsigned char>(bytes[i])} << 16;
    if (rest == 2) v |= uint32_t{static_cast<unsigned char>(bytes[i + 1])} << 8;
    out.push_back(kAlphabet[v >> 18]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.push_back(rest == 2 ? kAlphabet[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

StatusOr<std::string> Base64Decode(std::string_view text) {
  if (text.size() % 4 != 0) {
    return Error("base64 text of " + std::to_string(text.size()) +
                 " characters, expected a multiple of 4");
  }
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    int s[4];
    int pad = 0;
    for (int j = 0; j < 4; ++j) {
      const char c = text[i + j];
      if (c == '=' && i + 4 == text.size() && j >= 2) {
        s[j] = 0;
        ++pad;
        continue;
      }
      if (pad > 0) return Error("base64 padding inside the text");
      s[j] = Sextet(c);
      if (s[j] < 0)
        return Error("base64 character out of the alphabet at " + std::to_string(i + j));
    }
    const uint32_t v =
        (uint32_t(s[0]) << 18) | (uint32_t(s[1]) << 12) | (uint32_t(s[2]) << 6) | uint32_t(s[3]);
    out.push_back(static_cast<char>(v >> 16));
    if (pad < 2) out.push_back(static_cast<char>((v >> 8) & 0xff));
    if (pad < 1) out.push_back(static_cast<char>(v & 0xff));
  }
  return out;
}

}  // namespace pion::cluster
