// libFuzzer target for the binary protocol's frame parser (and the payload decoding of every
// command behind it).
//
// The first bytes choose the limits and the read-chunk pattern, the rest is the byte stream.
// The parser must never crash or touch memory out of bounds (ASan), and keep its contract:
// a command has at least its name, every argument lies inside what was received, a reject
// carries an error and a status, an error is final, and buffered bytes stay under the limit.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "feed.h"
#include "proto/binary_frame.h"

using pion::proto::CmdArgs;
using pion::proto::ParserLimits;
using pion::proto::binary::FrameParser;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  ParserLimits limits;
  limits.max_bulk_len = 1 + (data[0] % 8) * 4096;
  limits.query_buffer_limit = 1 << 16;
  limits.big_arg_threshold = 16 + (data[1] % 4) * 512;
  limits.unauth_max_bulk_len = 64 + (data[1] >> 2);
  limits.authenticated = (data[2] & 1) != 0;
  const size_t chunk_base = 1 + (data[2] >> 1);
  data += 3;
  size -= 3;

  FrameParser parser;
  parser.set_limits(limits);
  CmdArgs args;
  pion::fuzz::Feeder feed{data, size, chunk_base, limits.query_buffer_limit};
  while (true) {
    auto r = parser.Next(&args);
    if (r == FrameParser::Result::kCommand) {
      if (args.empty() || parser.status() != 0) __builtin_trap();
      for (size_t i = 0; i < args.size(); ++i) {
        volatile char sink = 0;
        for (char c : args[i]) sink = sink ^ c;  // touch every byte (ASan)
        (void)sink;
        if (args[i].size() > limits.query_buffer_limit) __builtin_trap();
      }
      args.Clear();
      continue;
    }
    if (r == FrameParser::Result::kReject) {
      if (parser.error().empty() || parser.status() == 0 || !args.empty()) __builtin_trap();
      continue;
    }
    if (r == FrameParser::Result::kError) {
      if (parser.error().empty() || parser.status() == 0) __builtin_trap();
      break;
    }
    if (!feed.Next(parser)) break;
  }
  return 0;
}
