// libFuzzer target for the RESP request parser.
//
// The first bytes of the input choose the limits and the read-chunk pattern, the rest is the
// byte stream. The parser must never crash, never read or write out of bounds (ASan), and
// keep its invariants: every command has at least one argument, a large argument is exactly
// the declared size, and after an error nothing more is produced.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "feed.h"
#include "proto/resp_parser.h"

using pion::proto::CmdArgs;
using pion::proto::ParserLimits;
using pion::proto::RespParser;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  ParserLimits limits;
  limits.max_bulk_len = 1 + (data[0] % 8) * 4096;
  limits.max_multibulk_len = 1 + data[1] % 64;
  limits.big_arg_threshold = 16 + (data[1] >> 6) * 512;
  limits.query_buffer_limit = 1 << 16;
  limits.max_inline_len = 1024;
  limits.authenticated = (data[2] & 1) != 0;
  const size_t chunk_base = 1 + (data[2] >> 1);
  data += 3;
  size -= 3;

  RespParser parser;
  parser.set_limits(limits);
  CmdArgs args;
  pion::fuzz::Feeder feed{data, size, chunk_base, limits.query_buffer_limit};
  bool failed = false;
  while (!failed) {
    auto r = parser.Next(&args);
    if (r == RespParser::Result::kCommand) {
      if (args.empty()) __builtin_trap();
      for (size_t i = 0; i < args.size(); ++i) {
        volatile char sink = 0;
        for (char c : args[i]) sink = sink ^ c;  // touch every byte (ASan)
        (void)sink;
        if (args[i].size() > limits.max_bulk_len && !args.IsBuffer(i) && args.size() > 1) {
          // Inline arguments are bounded by the line length instead.
          if (args[i].size() > limits.max_inline_len) __builtin_trap();
        }
      }
      continue;
    }
    if (r == RespParser::Result::kError) {
      failed = true;
      if (parser.error().empty()) __builtin_trap();
      if (parser.Next(&args) != RespParser::Result::kError) __builtin_trap();
      break;
    }
    if (!feed.Next(parser)) break;
  }
  return 0;
}
