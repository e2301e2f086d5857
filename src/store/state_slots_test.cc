#include "store/state_slots.h"

#include <gtest/gtest.h>

namespace pion::store {
namespace {

TenantKey K(const char* name, uint32_t tenant = 0) { return TenantKey{tenant, name}; }

TEST(StateSlots, AllocIsZeroFilledAndFixedSize) {
  StateSlots s;
  ASSERT_TRUE(s.Alloc(K("a"), 8).ok());
  const uint8_t* p = nullptr;
  auto buf = s.Read(K("a"), 0, 8, &p);
  ASSERT_TRUE(buf.ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(p), 8), std::string(8, '\0'));
  EXPECT_TRUE(s.Alloc(K("a"), 8).ok());  // same size: idempotent
  Status diff = s.Alloc(K("a"), 16);
  EXPECT_FALSE(diff.ok());
  EXPECT_NE(diff.message().find("exists with 8 bytes"), std::string::npos);
  EXPECT_FALSE(s.Alloc(K("z"), 0).ok());
}

TEST(StateSlots, WritesInPlaceAndChecksBounds) {
  StateSlots s;
  ASSERT_TRUE(s.Alloc(K("a"), 8).ok());
  ASSERT_TRUE(s.Write(K("a"), 2, "xyz").ok());
  ASSERT_TRUE(s.Write(K("a"), 5, "123").ok());  // exactly to the end
  const uint8_t* p = nullptr;
  ASSERT_TRUE(s.Read(K("a"), 0, 8, &p).ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(p), 8), std::string("\0\0xyz123", 8));
  Status over = s.Write(K("a"), 6, "abc");
  EXPECT_FALSE(over.ok());
  EXPECT_EQ(over.message(), "write of 3 bytes at offset 6 exceeds slot 'a' of 8 bytes");
  EXPECT_FALSE(s.Write(K("a"), UINT64_MAX, "a").ok());
  EXPECT_FALSE(s.Read(K("a"), 9, 0, &p).ok());
  EXPECT_FALSE(s.Read(K("a"), 4, 5, &p).ok());
  EXPECT_TRUE(s.Read(K("a"), 8, 0, &p).ok());
  EXPECT_EQ(s.Write(K("nope"), 0, "a").message(), "no such state slot 'nope'");
}

TEST(StateSlots, WriteDoesNotChangeBytesAReplyStillHolds) {
  StateSlots s;
  ASSERT_TRUE(s.Alloc(K("a"), 4).ok());
  ASSERT_TRUE(s.Write(K("a"), 0, "old!").ok());
  const uint8_t* p = nullptr;
  BufferRef held = s.Read(K("a"), 0, 4, &p).value();  // like a reply in flight
  ASSERT_TRUE(s.Write(K("a"), 0, "new!").ok());
  EXPECT_EQ(held->view(), "old!");
  ASSERT_TRUE(s.Read(K("a"), 0, 4, &p).ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(p), 4), "new!");
}

TEST(StateSlots, TenantsAreIsolated) {
  StateSlots s;
  ASSERT_TRUE(s.Alloc(K("same", 1), 4).ok());
  ASSERT_TRUE(s.Alloc(K("same", 2), 4).ok());
  ASSERT_TRUE(s.Write(K("same", 1), 0, "AAAA").ok());
  ASSERT_TRUE(s.Write(K("same", 2), 0, "BBBB").ok());
  const uint8_t* p = nullptr;
  ASSERT_TRUE(s.Read(K("same", 1), 0, 4, &p).ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(p), 4), "AAAA");
  EXPECT_FALSE(s.Read(K("same", 3), 0, 4, &p).ok());
  EXPECT_EQ(s.UsageOf(1).slots, 1u);
  EXPECT_EQ(s.Total().slots, 2u);
  EXPECT_EQ(s.Total().bytes, 8u);
}

TEST(StateSlots, BudgetRefusalLeavesNothingBehind) {
  StateSlots s;
  uint64_t used = 0;
  s.set_budget({[&](uint64_t n) {
                  if (used + n > 10) return Status(ErrorKind::kOom, "full");
                  used += n;
                  return Status::Ok();
                },
                [&](uint64_t n) { used -= n; }});
  ASSERT_TRUE(s.Alloc(K("a"), 8).ok());
  Status oom = s.Alloc(K("b"), 8);
  EXPECT_EQ(oom.kind(), ErrorKind::kOom);
  const uint8_t* p = nullptr;
  EXPECT_FALSE(s.Read(K("b"), 0, 1, &p).ok());
  EXPECT_TRUE(s.Free(K("a")));
  EXPECT_FALSE(s.Free(K("a")));
  EXPECT_EQ(used, 0u);
  EXPECT_TRUE(s.Alloc(K("b"), 8).ok());
}

}  // namespace
}  // namespace pion::store
