// ReplyBuffer: pending output bytes of one connection (or one reply in transit between
// shards), as a list of chunks that are either owned bytes or references into stored Buffers.
//
// Large values are referenced, not copied: a chunk holds a BufferRef and the socket writes
// straight from it with writev. The reference keeps the stored bytes alive until they are sent
// even if the value is dropped or replaced meanwhile.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

#include "common/buffer.h"

namespace pion::proto {

class ReplyBuffer {
 public:
  void Append(std::string_view bytes);
  void Append(char c);
  // References len bytes at p inside buf (p must point into buf).
  void AppendRef(BufferRef buf, const uint8_t* p, size_t len);
  // Passes file descriptors to the client (SCM_RIGHTS) with the bytes appended next: they
  // travel with the first write that carries those bytes. The fds stay owned by the caller and
  // must stay open until sent (the shared-memory segments are never closed).
  void AttachFds(std::vector<int> fds);
  // Moves all of other's chunks to the end of this buffer.
  void Splice(ReplyBuffer&& other);

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  // Fills up to max iovecs with the pending bytes; returns how many were filled. When the
  // front bytes carry file descriptors they are added to *fds (if fds is non-null), and the
  // iovecs stop before the next bytes that carry their own.
  int FillIovec(struct iovec* iov, int max, std::vector<int>* fds = nullptr) const;
  // Copies up to n of the pending bytes from the front into out; returns how many.
  size_t Peek(char* out, size_t n) const;
  // Drops n bytes from the front (after a successful write).
  void Consume(size_t n);
  void Clear();

 private:
  struct Chunk {
    std::string owned;
    std::vector<int> fds;  // sent with this chunk's first byte
    BufferRef ref;
    const uint8_t* ptr = nullptr;  // for ref chunks
    size_t len = 0;                // for ref chunks
    size_t length() const { return ref ? len : owned.size(); }
  };
  std::deque<Chunk> chunks_;
  size_t head_offset_ = 0;  // bytes of chunks_.front() already sent
  size_t size_ = 0;
};

}  // namespace pion::proto
