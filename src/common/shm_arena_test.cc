#include "common/shm_arena.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <set>

namespace pion {
namespace {

TEST(ShmArena, BuffersLiveInMappableSegments) {
  ShmArena arena("pion-test", 4u << 20);
  auto a = arena.Allocate(100000).value();
  auto b = arena.Allocate(200).value();
  ASSERT_GE(a->segment_fd(), 0);
  EXPECT_EQ(a->segment_fd(), b->segment_fd());
  EXPECT_EQ(a->segment_offset() % 4096, 0u);  // large: page-aligned
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 64, 0u);
  std::memset(a->data(), 0x5a, a->size());
  std::memcpy(b->data(), "hello", 5);
  // What another process would do: map the segment read-only through its fd.
  struct stat st {};
  ASSERT_EQ(fstat(a->segment_fd(), &st), 0);
  void* p = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, a->segment_fd(), 0);
  ASSERT_NE(p, MAP_FAILED);
  const auto* view = static_cast<const uint8_t*>(p);
  EXPECT_EQ(view[a->segment_offset() + 99999], 0x5a);
  EXPECT_EQ(std::memcmp(view + b->segment_offset(), "hello", 5), 0);
  munmap(p, st.st_size);
  // What clients get is read-only: it maps for reading, never for writing.
  const int ro = arena.segments()[0].read_fd;
  void* r = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, ro, 0);
  ASSERT_NE(r, MAP_FAILED);
  EXPECT_EQ(static_cast<const uint8_t*>(r)[a->segment_offset()], 0x5a);
  munmap(r, st.st_size);
  EXPECT_EQ(mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, ro, 0), MAP_FAILED);
  // The segment's size is sealed: a client's mapping can never be truncated under it.
  EXPECT_NE(ftruncate(a->segment_fd(), 0), 0);
}

TEST(ShmArena, RegionsNeverOverlapAndFreedSpaceIsReused) {
  ShmArena arena("pion-test", 2u << 20, /*retain_bytes=*/0);
  std::mt19937 rng(7);
  std::vector<BufferRef> live;
  for (int round = 0; round < 2000; ++round) {
    if (!live.empty() && rng() % 3 == 0) {
      live.erase(live.begin() + rng() % live.size());
      continue;
    }
    size_t size = 1 + rng() % (rng() % 4 == 0 ? 300000 : 3000);
    auto b = arena.Allocate(size);
    ASSERT_TRUE(b.ok());
    std::memset(b.value()->data(), static_cast<int>(round & 0xff), size);
    live.push_back(std::move(b).value());
  }
  // Every live buffer still holds its own fill byte: no two regions overlap.
  std::set<std::pair<int, uint64_t>> starts;
  for (const auto& b : live) {
    const uint8_t v = b->data()[0];
    for (size_t i = 0; i < b->size(); i += 97) ASSERT_EQ(b->data()[i], v);
    ASSERT_TRUE(starts.insert({b->segment_fd(), b->segment_offset()}).second);
  }
  const uint64_t mapped = arena.segment_bytes();
  live.clear();
  EXPECT_EQ(arena.used_bytes(), 0u);
  EXPECT_EQ(arena.free_bytes(), mapped);  // everything coalesced back
  auto again = arena.Allocate(1u << 20);  // fits in an existing segment: no new mapping
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(arena.segment_bytes(), mapped);
}

TEST(ShmArena, OversizedRequestGetsItsOwnSegment) {
  ShmArena arena("pion-test", 2u << 20);
  auto big = arena.Allocate(5u << 20).value();
  auto segs = arena.segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_GE(segs[0].size, 5u << 20);
  EXPECT_EQ(big->segment_offset(), 0u);
}

}  // namespace
}  // namespace pion
