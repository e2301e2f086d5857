// The byte feeder of the parser fuzz targets: hands the input to a parser the way a connection
// does (ReadSpan, copy, CommitRead), in chunks whose sizes cycle with `step` so that every
// field boundary is eventually split. Traps on a zero-length span (a recv of 0 bytes would look
// like EOF) and on buffered bytes beyond the parser's query limit plus slack.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace pion::fuzz {

struct Feeder {
  const uint8_t* data;
  size_t size;
  size_t chunk_base;
  uint64_t buffer_limit;
  size_t off = 0, step = 0;

  // Feeds the next chunk; false when the input is exhausted.
  template <typename Parser>
  bool Next(Parser& parser) {
    if (off >= size) return false;
    auto span = parser.ReadSpan();
    if (span.empty()) __builtin_trap();
    size_t n = chunk_base + (step++ % 7) * 13;
    if (n > span.size()) n = span.size();
    if (n > size - off) n = size - off;
    std::memcpy(span.data(), data + off, n);
    parser.CommitRead(n);
    off += n;
    if (parser.buffered_bytes() > buffer_limit + 2 * 65536) __builtin_trap();
    return true;
  }
};

}  // namespace pion::fuzz
