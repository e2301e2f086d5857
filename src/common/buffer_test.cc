#include "common/buffer.h"

#include <gtest/gtest.h>

#include <cstring>

namespace pion {
namespace {

TEST(Buffer, AllocationsAre64ByteAligned) {
  for (size_t size : {size_t{1}, size_t{100}, size_t{4096}, size_t{3} << 20}) {
    auto buf = BufferAllocator::Default()->Allocate(size);
    ASSERT_TRUE(buf.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.value()->data()) % 64, 0u) << size;
    EXPECT_EQ(buf.value()->size(), size);
    std::memset(buf.value()->data(), 0xab, size);  // writable end to end (ASan checks bounds)
    EXPECT_EQ(buf.value()->segment_fd(), -1);      // private heap memory
  }
}

TEST(Buffer, CopyToBufferIsByteExact) {
  std::string s(100000, '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 7);
  auto buf = CopyToBuffer(s);
  ASSERT_TRUE(buf.ok());
  EXPECT_EQ(buf.value()->view(), s);
}

TEST(Buffer, ImpossibleAllocationIsOom) {
  auto buf = BufferAllocator::Default()->Allocate(size_t{1} << 62);
  ASSERT_FALSE(buf.ok());
  EXPECT_EQ(buf.status().kind(), ErrorKind::kOom);
}

}  // namespace
}  // namespace pion
