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

namespace pion {
namespace {

TEST(Buffer, FreedLargeRegionsAreReusedWithoutNewMappings) {
  auto* alloc = BufferAllocator::Default();
  const uint8_t* first = nullptr;
  {
    auto a = alloc->Allocate(4 << 20);
    ASSERT_TRUE(a.ok());
    first = a.value()->data();
    std::memset(a.value()->data(), 1, 4 << 20);
  }
  EXPECT_GE(alloc->cached_bytes(), uint64_t{4} << 20);
  auto b = alloc->Allocate((4 << 20) - 100);  // same size class: the cached region comes back
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b.value()->data(), first);
  EXPECT_EQ(b.value()->size(), size_t{(4 << 20) - 100});
  // A much smaller request does not take a far larger cached region.
  auto c = alloc->Allocate(1 << 20);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(c.value()->data(), first);
}

}  // namespace
}  // namespace pion
