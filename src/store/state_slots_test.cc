#include "store/state_slots.h"

#include <gtest/gtest.h>

#include <cstring>

#include "residency/engine.h"

namespace pion::store {
namespace {

TenantKey K(const char* name, uint32_t tenant = 0) { return TenantKey{tenant, name}; }

class StateSlotsTest : public ::testing::Test {
 protected:
  residency::ObjectRef Zeros(uint64_t n) {
    auto b = BufferAllocator::Default()->Allocate(n).value();
    std::memset(b->data(), 0, n);
    return engine_.CreateInHost(residency::Family::kState, {b}, nullptr);
  }
  std::string Bytes(StateSlots& s, const TenantKey& k) {
    BufferRef b = s.Find(k).value()->obj->HostBlock(0);
    return std::string(b->view());
  }
  residency::Engine engine_{residency::EngineOptions{}};
};

TEST_F(StateSlotsTest, AllocIsIdempotentForTheSameSizeOnly) {
  StateSlots s;
  bool exists = true;
  ASSERT_TRUE(s.CheckAlloc(K("a"), 8, &exists).ok());
  EXPECT_FALSE(exists);
  s.Insert(K("a"), Zeros(8));
  EXPECT_EQ(Bytes(s, K("a")), std::string(8, '\0'));
  ASSERT_TRUE(s.CheckAlloc(K("a"), 8, &exists).ok());
  EXPECT_TRUE(exists);
  Status diff = s.CheckAlloc(K("a"), 16, &exists);
  EXPECT_FALSE(diff.ok());
  EXPECT_NE(diff.message().find("exists with 8 bytes"), std::string::npos);
  EXPECT_FALSE(s.CheckAlloc(K("z"), 0, &exists).ok());
}

TEST_F(StateSlotsTest, WritesInPlaceAndChecksBounds) {
  StateSlots s;
  StateSlots::Slot& sl = s.Insert(K("a"), Zeros(8));
  ASSERT_TRUE(StateSlots::WriteInPlace(sl, 2, "xyz", 0));
  ASSERT_TRUE(StateSlots::WriteInPlace(sl, 5, "123", 0));  // exactly to the end
  EXPECT_EQ(Bytes(s, K("a")), std::string("\0\0xyz123", 8));
  EXPECT_EQ(sl.obj->generation(), 3u);
  Status over = StateSlots::CheckRange(K("a"), sl, 6, 3, "write");
  EXPECT_EQ(over.message(), "write of 3 bytes at offset 6 exceeds slot 'a' of 8 bytes");
  EXPECT_FALSE(StateSlots::CheckRange(K("a"), sl, UINT64_MAX, 1, "write").ok());
  EXPECT_FALSE(StateSlots::CheckRange(K("a"), sl, 9, 0, "read").ok());
  EXPECT_FALSE(StateSlots::CheckRange(K("a"), sl, 4, 5, "read").ok());
  EXPECT_TRUE(StateSlots::CheckRange(K("a"), sl, 8, 0, "read").ok());
  EXPECT_EQ(s.Find(K("nope")).status().message(), "no such state slot 'nope'");
}

TEST_F(StateSlotsTest, BytesAReplyStillHoldsAreNeverWrittenInPlace) {
  StateSlots s;
  StateSlots::Slot& sl = s.Insert(K("a"), Zeros(4));
  ASSERT_TRUE(StateSlots::WriteInPlace(sl, 0, "old!", 0));
  BufferRef held = sl.obj->HostBlock(0);                     // like a reply in flight
  EXPECT_FALSE(StateSlots::WriteInPlace(sl, 0, "new!", 0));  // the caller copies instead
  EXPECT_EQ(held->view(), "old!");
  held.reset();
  EXPECT_TRUE(StateSlots::WriteInPlace(sl, 0, "new!", 0));
  EXPECT_EQ(Bytes(s, K("a")), "new!");
}

TEST_F(StateSlotsTest, TenantsAreIsolatedAndFreeForgets) {
  StateSlots s;
  s.Insert(K("same", 1), Zeros(4));
  s.Insert(K("same", 2), Zeros(4));
  EXPECT_FALSE(s.Find(K("same", 3)).ok());
  EXPECT_EQ(s.UsageOf(1).slots, 1u);
  EXPECT_EQ(s.Total().slots, 2u);
  EXPECT_EQ(s.Total().bytes, 8u);
  EXPECT_TRUE(s.Free(K("same", 1)));
  EXPECT_FALSE(s.Free(K("same", 1)));
  EXPECT_EQ(s.Total().bytes, 4u);
}

}  // namespace
}  // namespace pion::store
