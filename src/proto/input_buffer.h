// InputBuffer: the receive side of a connection's parser (RespParser, binary::FrameParser).
//
// The connection asks ReadSpan() where to receive and reports the byte count with CommitRead().
// Normally that is a growable buffer of unparsed input (compacted, then doubled, when less than
// 4 KiB is free). While the parser fills a large argument's or payload's own Buffer and has no
// buffered bytes left, the span points straight into that Buffer, so the socket writes the
// bytes into their final place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "common/buffer.h"

namespace pion::proto {

class InputBuffer {
 public:
  static constexpr size_t kInitialSize = 16 * 1024;
  static constexpr size_t kMinReadSpan = 4 * 1024;

  InputBuffer() : buf_(kInitialSize) {}

  // target: the Buffer being filled, or null; *filled: its bytes received so far (advanced by
  // CommitRead when the span went there).
  std::span<uint8_t> ReadSpan(Buffer* target, uint64_t* filled) {
    if (target != nullptr && avail() == 0 && *filled < target->size()) {
      target_filled_ = filled;
      return {target->data() + *filled, target->size() - *filled};
    }
    target_filled_ = nullptr;
    if (buf_.size() - wpos_ < kMinReadSpan) {
      if (rpos_ > 0) {  // compact: move the unparsed tail to the front
        std::memmove(buf_.data(), buf_.data() + rpos_, avail());
        wpos_ -= rpos_;
        rpos_ = 0;
      }
      if (buf_.size() - wpos_ < kMinReadSpan) buf_.resize(buf_.size() * 2);
    }
    return {buf_.data() + wpos_, buf_.size() - wpos_};
  }

  // n bytes were written into the span returned by the last ReadSpan().
  void CommitRead(size_t n) {
    if (target_filled_ != nullptr) {
      *target_filled_ += n;
    } else {
      wpos_ += n;
    }
  }

  // The unparsed bytes.
  size_t avail() const { return wpos_ - rpos_; }
  const uint8_t* data() const { return buf_.data() + rpos_; }
  const char* chars() const { return reinterpret_cast<const char*>(data()); }
  void Consume(size_t n) { rpos_ += n; }
  // Forgets the (fully parsed) contents, so the next read starts at the front.
  void Reset() { rpos_ = wpos_ = 0; }
  size_t capacity() const { return buf_.size(); }

 private:
  std::vector<uint8_t> buf_;
  size_t rpos_ = 0;
  size_t wpos_ = 0;
  uint64_t* target_filled_ = nullptr;
};

}  // namespace pion::proto
