#include "proto/cmd_args.h"

namespace pion::proto {

StatusOr<BufferRef> CmdArgs::TakeBuffer(size_t i, BufferAllocator* alloc) {
  if (slots_[i].big) return slots_[i].big;
  return CopyToBuffer((*this)[i], alloc);
}

void CmdArgs::Clear() {
  small_.clear();
  slots_.clear();
  big_bytes_ = 0;
}

void CmdArgs::AppendSmall(std::string_view s) {
  slots_.push_back(Slot{static_cast<uint32_t>(small_.size()), static_cast<uint32_t>(s.size()), {}});
  small_.append(s);
}

void CmdArgs::AppendBuffer(BufferRef buf) {
  big_bytes_ += buf->size();
  slots_.push_back(Slot{0, 0, std::move(buf)});
}

}  // namespace pion::proto
