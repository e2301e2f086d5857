// Human-readable byte sizes: "512mb", "2gb", "1048576", "64k".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pion {

// Parses a size with an optional unit suffix (b, k/kb, m/mb, g/gb, t/tb; powers of 1024,
// case-insensitive). Returns nullopt on malformed input or overflow.
std::optional<uint64_t> ParseByteSize(std::string_view text);

// "1.50G", "64.00M", "512B" — for INFO's *_human fields.
std::string HumanBytes(uint64_t bytes);

// Parses a decimal int64 with no leading '+' and no trailing garbage (Redis string2ll rules).
bool ParseInt64(std::string_view text, int64_t* out);

}  // namespace pion
