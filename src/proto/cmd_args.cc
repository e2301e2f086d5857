#include "proto/cmd_args.h"

#include <algorithm>
#include <cstddef>

namespace pion::proto {

StatusOr<BufferRef> CmdArgs::TakeBuffer(size_t i, BufferAllocator* alloc) {
  if (IsBuffer(i)) return slots_[i].big;
  return CopyToBuffer((*this)[i], alloc);
}

void CmdArgs::Clear() {
  small_.clear();
  slots_.clear();
  big_bytes_ = 0;
}

void CmdArgs::PopBack(size_t n) {
  for (; n > 0 && !slots_.empty(); --n) {
    if (slots_.back().big) big_bytes_ -= slots_.back().length;
    slots_.pop_back();
  }
}

void CmdArgs::Erase(size_t i, size_t n) {
  if (i >= slots_.size()) return;
  n = std::min(n, slots_.size() - i);
  for (size_t j = i; j < i + n; ++j) {
    if (slots_[j].big) big_bytes_ -= slots_[j].length;
  }
  slots_.erase(slots_.begin() + static_cast<std::ptrdiff_t>(i),
               slots_.begin() + static_cast<std::ptrdiff_t>(i + n));
}

void CmdArgs::AppendSmall(std::string_view s) {
  slots_.push_back(Slot{small_.size(), s.size(), {}});
  small_.append(s);
}

void CmdArgs::AppendBuffer(BufferRef buf) {
  big_bytes_ += buf->size();
  const size_t n = buf->size();
  slots_.push_back(Slot{0, n, std::move(buf)});
}

void CmdArgs::AppendSlice(BufferRef buf, size_t offset, size_t length) {
  big_bytes_ += length;  // the payload Buffer is counted by its slices
  slots_.push_back(Slot{offset, length, std::move(buf)});
}

}  // namespace pion::proto
