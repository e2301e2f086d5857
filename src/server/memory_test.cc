#include "server/memory.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace pion::server {
namespace {

TEST(MemoryAccountant, UnlimitedWhenMaxmemoryIsZero) {
  MemoryAccountant m;
  EXPECT_TRUE(m.Reserve(MemFamily::kState, uint64_t{1} << 50).ok());
  EXPECT_EQ(m.used(MemFamily::kState), uint64_t{1} << 50);
}

TEST(MemoryAccountant, OomNamesRequestAndFree) {
  MemoryAccountant m;
  m.set_maxmemory(1000);
  ASSERT_TRUE(m.Reserve(MemFamily::kState, 600).ok());
  Status s = m.Reserve(MemFamily::kSsm, 500);
  ASSERT_EQ(s.kind(), ErrorKind::kOom);
  EXPECT_NE(s.message().find("ssm write of 500 bytes, 400 bytes free of maxmemory 1000"),
            std::string::npos)
      << s.message();
  EXPECT_EQ(m.used(), 600u);
  EXPECT_EQ(m.oom_rejections(), 1u);
  m.Release(MemFamily::kState, 600);
  EXPECT_TRUE(m.Reserve(MemFamily::kSsm, 500).ok());
}

TEST(MemoryAccountant, OwningFamilyReclaimsFirst) {
  MemoryAccountant m;
  m.set_maxmemory(1000);
  ASSERT_TRUE(m.Reserve(MemFamily::kVStore, 900).ok());
  uint64_t asked = 0;
  m.SetReclaimer(MemFamily::kVStore, [&](uint64_t need, bool) {
    asked = need;
    m.Release(MemFamily::kVStore, 500);
    return uint64_t{500};
  });
  EXPECT_TRUE(m.Reserve(MemFamily::kVStore, 300).ok());
  EXPECT_EQ(asked, 200u);  // exactly the shortfall
  EXPECT_EQ(m.used(), 700u);
  // Another family's write does not evict the V-store (it has no reclaimer of its own).
  EXPECT_EQ(m.Reserve(MemFamily::kState, 400).kind(), ErrorKind::kOom);
}

TEST(MemoryAccountant, ConcurrentReservationsNeverOvershoot) {
  MemoryAccountant m;
  m.set_maxmemory(100000);
  std::vector<std::thread> threads;
  std::atomic<uint64_t> granted{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        if (m.Reserve(MemFamily::kState, 7).ok()) granted.fetch_add(7);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(m.used(), 100000u);
  EXPECT_EQ(m.used(), granted.load());
  EXPECT_GT(m.used(), 100000u - 7);
}

}  // namespace
}  // namespace pion::server
