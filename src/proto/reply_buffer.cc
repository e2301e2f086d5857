#include "proto/reply_buffer.h"

#include <algorithm>
#include <cstring>

namespace pion::proto {
namespace {
// An owned chunk grows up to this size before a new one is started, so the front chunk's
// sent prefix can be released chunk by chunk.
constexpr size_t kOwnedChunkMax = 64 * 1024;
}  // namespace

void ReplyBuffer::AttachFds(std::vector<int> fds) {
  if (fds.empty()) return;
  chunks_.emplace_back();
  chunks_.back().fds = std::move(fds);
}

void ReplyBuffer::Append(std::string_view bytes) {
  if (bytes.empty()) return;
  const bool fresh_fd_chunk =
      !chunks_.empty() && !chunks_.back().fds.empty() && chunks_.back().owned.empty();
  if (!fresh_fd_chunk &&
      (chunks_.empty() || chunks_.back().ref || chunks_.back().owned.size() >= kOwnedChunkMax ||
       (chunks_.size() == 1 && head_offset_ > 0))) {
    chunks_.emplace_back();
    chunks_.back().owned.reserve(bytes.size() < 256 ? 256 : bytes.size());
  }
  chunks_.back().owned.append(bytes);
  size_ += bytes.size();
}

void ReplyBuffer::Append(char c) { Append(std::string_view(&c, 1)); }

void ReplyBuffer::AppendRef(BufferRef buf, const uint8_t* p, size_t len) {
  if (len == 0) return;
  Chunk c;
  c.ref = std::move(buf);
  c.ptr = p;
  c.len = len;
  chunks_.push_back(std::move(c));
  size_ += len;
}

void ReplyBuffer::Splice(ReplyBuffer&& other) {
  if (other.empty()) return;
  bool first = true;
  for (auto& c : other.chunks_) {
    if (first && other.head_offset_ > 0) {
      // Keep only the unsent part of other's front chunk.
      if (c.ref) {
        AppendRef(std::move(c.ref), c.ptr + other.head_offset_, c.len - other.head_offset_);
      } else {
        Append(std::string_view(c.owned).substr(other.head_offset_));
      }
    } else if (c.ref) {
      size_ += c.len;
      chunks_.push_back(std::move(c));
    } else {
      AttachFds(std::move(c.fds));
      Append(c.owned);
    }
    first = false;
  }
  other.Clear();
}

int ReplyBuffer::FillIovec(struct iovec* iov, int max, std::vector<int>* fds) const {
  int n = 0;
  size_t skip = head_offset_;
  for (const auto& c : chunks_) {
    if (n == max) break;
    if (!c.fds.empty()) {
      if (n > 0) break;  // its fds go with its own write
      if (fds != nullptr) *fds = c.fds;
    }
    const uint8_t* base = c.ref ? c.ptr : reinterpret_cast<const uint8_t*>(c.owned.data());
    iov[n].iov_base = const_cast<uint8_t*>(base + skip);
    iov[n].iov_len = c.length() - skip;
    skip = 0;
    ++n;
  }
  return n;
}

size_t ReplyBuffer::Peek(char* out, size_t n) const {
  size_t got = 0;
  size_t skip = head_offset_;
  for (const auto& c : chunks_) {
    if (got == n) break;
    const uint8_t* base = c.ref ? c.ptr : reinterpret_cast<const uint8_t*>(c.owned.data());
    const size_t take = std::min(n - got, c.length() - skip);
    std::memcpy(out + got, base + skip, take);
    got += take;
    skip = 0;
  }
  return got;
}

void ReplyBuffer::Consume(size_t n) {
  if (n > 0 && !chunks_.empty()) chunks_.front().fds.clear();  // they went with this write
  size_ -= n;
  n += head_offset_;
  while (!chunks_.empty() && n >= chunks_.front().length()) {
    n -= chunks_.front().length();
    chunks_.pop_front();
  }
  head_offset_ = chunks_.empty() ? 0 : n;
}

void ReplyBuffer::Clear() {
  chunks_.clear();
  head_offset_ = 0;
  size_ = 0;
}

}  // namespace pion::proto
