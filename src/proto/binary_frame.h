// The 0xCA5E binary protocol (port 1975): frame layout and the incremental frame parser.
//
// Every frame, request or reply, is a 24-byte little-endian header and a payload:
//
//   offset  size  field
//        0     2  magic 0xCA5E (bytes 5E CA)
//        2     1  version (1)
//        3     1  command (a request's code; a reply's is the request's | 0x80)
//        4     2  flags (0 in version 1)
//        6     2  status (0 in requests; a reply's FrameStatus)
//        8     8  request id (chosen by the client, echoed in the reply)
//       16     8  payload length
//
// A request's payload is its command's fields (binary_commands.h); the parser turns a frame
// into the arguments of the equivalent RESP command, so both protocols run the same handlers
// on the same stores. A reply's payload is the command's reply in the typed encoding of
// ReplyBuilder (kBinaryReplies) when the status is 0, else the error text.
//
// Errors: a frame whose header is bad (magic, version) or whose payload is over the limit is
// fatal to the connection (kError: the stream cannot be trusted past it). A well-framed
// request that cannot run — unknown command, nonzero flags or status, fields that do not fit
// its payload — is consumed whole and rejected (kReject); the connection goes on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/buffer.h"
#include "proto/cmd_args.h"
#include "proto/input_buffer.h"
#include "proto/resp_parser.h"

namespace pion::proto::binary {

inline constexpr uint16_t kMagic = 0xCA5E;
inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kHeaderSize = 24;
inline constexpr uint8_t kReplyBit = 0x80;

// A reply's status: 0, the error kinds of common/status.h (1 ERR … 13 DEVERR, the same
// numbers as ErrorKind), and the frame-level errors from 64.
enum class FrameStatus : uint16_t {
  kOk = 0,
  kBadFrame = 64,        // bad magic, flags or status set in a request, fields past the payload
  kUnknownCommand = 65,  // no such command code
  kBadVersion = 66,      // a version this server does not speak
  kTooLarge = 67,        // payload over the connection's limit
};

struct FrameHeader {
  uint8_t version = kVersion;
  uint8_t command = 0;
  uint16_t flags = 0;
  uint16_t status = 0;
  uint64_t request_id = 0;
  uint64_t payload_len = 0;
};

void EncodeHeader(const FrameHeader& h, uint8_t out[kHeaderSize]);
// False when the first two bytes are not the magic.
bool DecodeHeader(const uint8_t in[kHeaderSize], FrameHeader* h);

// The status of an error reply line ("MISS no attention session ..."), from its prefix.
uint16_t StatusOfError(std::string_view error_line);

class FrameParser {
 public:
  enum class Result { kNeedMore, kCommand, kReject, kError };

  explicit FrameParser(BufferAllocator* alloc = BufferAllocator::Default());

  // max_bulk_len bounds each blob field, query_buffer_limit the payload, big_arg_threshold
  // the payload size read straight into its own Buffer; before AUTH (authenticated false)
  // payloads are at most unauth_max_bulk_len.
  void set_limits(const ParserLimits& limits) { limits_ = limits; }

  std::span<uint8_t> ReadSpan();
  void CommitRead(size_t n);

  // kCommand: *out holds the RESP arguments of the frame header() describes. kReject: the
  // frame was consumed and must be answered with status() and error(). kError: answer with
  // status() and error(), then close; the parser is unusable.
  Result Next(CmdArgs* out);

  const FrameHeader& header() const { return header_; }
  uint16_t status() const { return status_; }
  const std::string& error() const { return error_; }
  bool query_limit_hit() const { return status_ == static_cast<uint16_t>(FrameStatus::kTooLarge); }

  uint64_t buffered_bytes() const { return in_.avail() + (big_ ? big_->size() : 0); }
  size_t buffer_capacity() const { return in_.capacity(); }

 private:
  enum class State { kHeader, kSmall, kBig, kSkip };

  Result Fail(FrameStatus status, std::string message);
  Result Reject(uint16_t status, std::string message);
  Result Decode(const BufferRef& big, const uint8_t* payload, CmdArgs* out);

  BufferAllocator* alloc_;
  ParserLimits limits_;
  InputBuffer in_;

  State state_ = State::kHeader;
  FrameHeader header_;
  BufferRef big_;
  uint64_t big_filled_ = 0;
  uint64_t skip_left_ = 0;
  uint16_t skip_status_ = 0;
  std::string skip_error_;

  uint16_t status_ = 0;
  std::string error_;
};

}  // namespace pion::proto::binary
