// ReplyBuilder: writes RESP2 or RESP3 replies into a ReplyBuffer.
//
// Families describe replies in protocol-neutral terms (map, array, bulk, null, double) and
// the builder encodes them for the connection's protocol: RESP2 or RESP3 (HELLO 2|3), or the
// typed binary encoding of the 0xCA5E protocol (version kBinaryReplies; docs/PROTOCOL.md,
// "Binary protocol"). Large bulk replies are referenced from the stored Buffer rather than
// copied.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/buffer.h"
#include "common/status.h"
#include "proto/reply_buffer.h"

namespace pion::proto {

// The reply "version" of a binary-protocol connection (RESP versions are 2 and 3).
inline constexpr int kBinaryReplies = 0;

class ReplyBuilder {
 public:
  ReplyBuilder(ReplyBuffer* out, int version)
      : out_(out), resp3_(version >= 3), binary_(version == kBinaryReplies) {}

  bool resp3() const { return resp3_; }
  bool binary() const { return binary_; }
  // 2, 3 or kBinaryReplies: what a builder for a deferred reply must be constructed with.
  int version() const { return binary_ ? kBinaryReplies : (resp3_ ? 3 : 2); }
  void set_resp_version(int v) {
    resp3_ = v >= 3;
    binary_ = v == kBinaryReplies;
  }
  ReplyBuffer* buffer() { return out_; }
  void set_buffer(ReplyBuffer* out) { out_ = out; }

  void Ok() {
    if (binary_) {
      SimpleString("OK");
    } else {
      out_->Append("+OK\r\n");
    }
  }
  void SimpleString(std::string_view s);
  // "-<PREFIX> <message>\r\n" from a non-ok Status.
  void Error(const Status& status);
  // Raw error line without '-' or CRLF, e.g. "ERR unknown command ...". CR/LF are replaced.
  void ErrorLine(std::string_view line);
  void Integer(int64_t v);
  void Double(double v);
  // A measured value, rounded to what it measures: `decimals` places, trailing zeros dropped
  // (micros from a nanosecond clock: 3; a fraction: 6). RESP3 double, RESP2 bulk string.
  void Double(double v, int decimals);
  void Bool(bool v);
  void Bulk(std::string_view s);
  // Bulk reply of len bytes at p inside buf; referenced without copying when large.
  void BulkRef(const BufferRef& buf, const uint8_t* p, size_t len);
  void BulkRef(const BufferRef& buf) { BulkRef(buf, buf->data(), buf->size()); }
  // A bulk reply assembled from pieces: BulkStart(total), BulkPiece()... summing to total,
  // then BulkEnd(). Large pieces are referenced, small ones copied.
  void BulkStart(size_t total) { Header('$', total); }
  void BulkPiece(const BufferRef& buf, const uint8_t* p, size_t len);
  void BulkEnd() {
    if (!binary_) out_->Append("\r\n");
  }
  // File descriptors passed (SCM_RIGHTS) with the next reply bytes; see ReplyBuffer::AttachFds.
  void AttachFds(std::vector<int> fds) { out_->AttachFds(std::move(fds)); }
  void Null();       // RESP2 "$-1", RESP3 "_"
  void NullArray();  // RESP2 "*-1", RESP3 "_"
  void Array(size_t n);
  void Map(size_t n);  // n key/value pairs; RESP2 flattens to an array of 2n
  void Set(size_t n);
  // Text for humans (INFO, CLIENT LIST): RESP3 verbatim string, RESP2 bulk.
  void Verbatim(std::string_view txt);

  // Errors written since construction / the last ResetErrorCount (for command stats).
  int errors() const { return errors_; }
  void ResetErrorCount() { errors_ = 0; }

 private:
  // RESP: "<type><n>\r\n"; binary: the type byte and n as a little-endian uint64.
  void Header(char type, uint64_t n);
  // The end of a string or bulk: CRLF in RESP, nothing in binary.
  void End() {
    if (!binary_) out_->Append("\r\n");
  }
  ReplyBuffer* out_;
  bool resp3_;
  bool binary_;
  int errors_ = 0;
};

}  // namespace pion::proto
