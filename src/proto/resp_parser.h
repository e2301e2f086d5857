// RespParser: incremental parser for RESP2/RESP3 requests (multibulk) and inline commands.
//
// The parser owns the connection's input buffer. The connection asks ReadSpan() where to
// receive next, reads into it, and reports the byte count with CommitRead(). While a large
// bulk argument is being received, ReadSpan() points straight into that argument's final
// Buffer, so a multi-gigabyte tensor crosses from the socket to the store with no extra copy.
//
// Limits follow Redis (proto-max-bulk-len, max multibulk length, 64 KiB inline lines,
// pre-auth caps of 10 arguments and 16 KiB bulks) and a query-buffer limit on the bytes one
// client may have buffered. Any violation is a protocol error after which the caller replies
// with error() and closes the connection.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "proto/cmd_args.h"
#include "proto/input_buffer.h"

namespace pion::proto {

struct ParserLimits {
  uint64_t max_bulk_len = 2ull << 30;        // --proto-max-bulk-len
  int64_t max_multibulk_len = 1024 * 1024;   // --max-multibulk-len
  uint64_t query_buffer_limit = 4ull << 30;  // --client-query-buffer-limit
  size_t max_inline_len = 64 * 1024;
  size_t big_arg_threshold = 32 * 1024;  // bulks this large get their own Buffer
  bool authenticated = true;             // false: pre-auth caps apply
  int64_t unauth_max_multibulk_len = 10;
  uint64_t unauth_max_bulk_len = 16 * 1024;
};

class RespParser {
 public:
  enum class Result { kNeedMore, kCommand, kError };
  enum class ErrorReason { kNone, kProtocol, kQueryBufferLimit, kOutOfMemory };

  explicit RespParser(BufferAllocator* alloc = BufferAllocator::Default());

  void set_limits(const ParserLimits& limits) { limits_ = limits; }
  const ParserLimits& limits() const { return limits_; }

  // Writable memory to receive into; never empty.
  std::span<uint8_t> ReadSpan();
  // n bytes were written into the span returned by the last ReadSpan().
  void CommitRead(size_t n);

  // Parses the next complete command into *out. kNeedMore: feed more bytes. kError: see
  // error()/reason(); the parser is then unusable.
  Result Next(CmdArgs* out);

  // The protocol error text without the "ERR Protocol error: " prefix.
  const std::string& error() const { return error_; }
  ErrorReason reason() const { return reason_; }

  // Bytes held for this client: unparsed input plus the partially assembled command.
  uint64_t buffered_bytes() const;
  // Capacity of the small input buffer (for INFO clients / memory accounting).
  size_t buffer_capacity() const { return in_.capacity(); }

  // Splits an inline command line like Redis' sdssplitargs (quotes, \xHH escapes).
  // Returns false on unbalanced quotes.
  static bool SplitInline(std::string_view line, CmdArgs* out);

 private:
  enum class State { kIdle, kArgHeader, kSmallBulk, kBigBulk, kBigBulkCrlf };

  Result Fail(ErrorReason reason, std::string message);
  // Finds the "\r\n"-terminated line at the front of the input; returns the length of the text
  // before '\r', or -1.
  int64_t FindLine() const;

  BufferAllocator* alloc_;
  ParserLimits limits_;
  InputBuffer in_;

  State state_ = State::kIdle;
  int64_t args_left_ = 0;
  uint64_t bulk_len_ = 0;
  BufferRef big_;
  uint64_t big_filled_ = 0;
  CmdArgs pending_;

  ErrorReason reason_ = ErrorReason::kNone;
  std::string error_;
};

}  // namespace pion::proto
