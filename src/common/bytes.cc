#include "common/bytes.h"

#include <cctype>
#include <charconv>
#include <cstdio>

namespace pion {

std::optional<uint64_t> ParseByteSize(std::string_view text) {
  // <digits>[.<digits>][unit]: a decimal needs a unit larger than a byte ("1.5gb").
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  if (i == 0) return std::nullopt;
  uint64_t base = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + i, base);
  if (ec != std::errc() || ptr != text.data() + i) return std::nullopt;
  std::string_view frac;
  if (i < text.size() && text[i] == '.') {
    const size_t f0 = ++i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
    frac = text.substr(f0, i - f0);
    if (frac.empty() || frac.size() > 12) return std::nullopt;
  }
  std::string unit;
  for (char c : text.substr(i))
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  uint64_t mult = 1;
  if (unit.empty() || unit == "b") {
    mult = 1;
  } else if (unit == "k" || unit == "kb") {
    mult = 1ull << 10;
  } else if (unit == "m" || unit == "mb") {
    mult = 1ull << 20;
  } else if (unit == "g" || unit == "gb") {
    mult = 1ull << 30;
  } else if (unit == "t" || unit == "tb") {
    mult = 1ull << 40;
  } else {
    return std::nullopt;
  }
  if (base != 0 && mult > UINT64_MAX / base) return std::nullopt;
  uint64_t bytes = base * mult;
  if (!frac.empty()) {
    if (mult == 1) return std::nullopt;  // a fraction of a byte
    uint64_t num = 0, den = 1;
    for (char c : frac) {
      num = num * 10 + static_cast<uint64_t>(c - '0');
      den *= 10;
    }
    // num/den of the unit, rounded down to a whole byte (mult ≤ 2^40, num < 10^12: no overflow
    // in 128 bits).
    const auto part = static_cast<uint64_t>(static_cast<unsigned __int128>(num) * mult / den);
    if (bytes > UINT64_MAX - part) return std::nullopt;
    bytes += part;
  }
  return bytes;
}

std::string HumanBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "K", "M", "G", "T"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char out[32];
  if (u == 0) {
    std::snprintf(out, sizeof(out), "%lluB", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(out, sizeof(out), "%.2f%s", v, kUnits[u]);
  }
  return out;
}

bool ParseInt64(std::string_view text, int64_t* out) {
  if (text.empty() || text.size() > 20 || text[0] == '+') return false;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && ptr == text.data() + text.size();
}

}  // namespace pion
