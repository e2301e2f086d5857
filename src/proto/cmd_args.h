// CmdArgs: the arguments of one parsed command.
//
// Small arguments are packed into one string; each large bulk argument (at or above the
// parser's big-argument threshold) lives in its own Buffer that the parser filled straight
// from the socket, so a family can adopt it as a stored value without copying it. A binary
// frame's large payload is one Buffer and its fields are slices of it (AppendSlice): read in
// place, copied only when a family adopts one (TakeBuffer).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/buffer.h"

namespace pion::proto {

class CmdArgs {
 public:
  size_t size() const { return slots_.size(); }
  bool empty() const { return slots_.empty(); }

  std::string_view operator[](size_t i) const {
    const Slot& s = slots_[i];
    if (s.big) return s.big->view().substr(s.offset, s.length);
    return std::string_view(small_.data() + s.offset, s.length);
  }

  // True when argument i was read into its own Buffer (a whole one, not a slice).
  bool IsBuffer(size_t i) const {
    return slots_[i].big != nullptr && slots_[i].length == slots_[i].big->size();
  }

  // Returns argument i as a Buffer: the parser's own Buffer when it has one (no copy),
  // otherwise (small argument or slice) a fresh copy from `alloc`.
  StatusOr<BufferRef> TakeBuffer(size_t i, BufferAllocator* alloc = BufferAllocator::Default());

  // Total bytes held by the arguments.
  uint64_t bytes() const { return small_.size() + big_bytes_; }

  void Clear();
  // Drops the last n arguments (trailing options a dispatcher consumed).
  void PopBack(size_t n);
  // Drops arguments [i, i + n) (options a dispatcher consumed among others); later ones move up.
  void Erase(size_t i, size_t n);
  void Reserve(size_t n) { slots_.reserve(n); }
  void AppendSmall(std::string_view s);
  void AppendBuffer(BufferRef buf);
  // length bytes of buf from offset (within buf's size).
  void AppendSlice(BufferRef buf, size_t offset, size_t length);

 private:
  struct Slot {
    uint64_t offset = 0;  // into small_, or into big
    uint64_t length = 0;
    BufferRef big;
  };
  std::string small_;
  std::vector<Slot> slots_;
  uint64_t big_bytes_ = 0;
};

}  // namespace pion::proto
