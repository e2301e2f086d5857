#include "common/bytes.h"

#include <gtest/gtest.h>

namespace pion {
namespace {

TEST(ParseByteSize, UnitsArePowersOf1024) {
  EXPECT_EQ(ParseByteSize("0"), 0u);
  EXPECT_EQ(ParseByteSize("512"), 512u);
  EXPECT_EQ(ParseByteSize("512b"), 512u);
  EXPECT_EQ(ParseByteSize("64k"), 64u << 10);
  EXPECT_EQ(ParseByteSize("64KB"), 64u << 10);
  EXPECT_EQ(ParseByteSize("512mb"), 512ull << 20);
  EXPECT_EQ(ParseByteSize("2gb"), 2ull << 30);
  EXPECT_EQ(ParseByteSize("1T"), 1ull << 40);
}

TEST(ParseByteSize, DecimalsWithAUnitRoundDownToWholeBytes) {
  EXPECT_EQ(ParseByteSize("1.5gb"), 3ull << 29);
  EXPECT_EQ(ParseByteSize("0.5k"), 512u);
  EXPECT_EQ(ParseByteSize("1.3kb"), 1331u);  // 1331.2
  EXPECT_EQ(ParseByteSize("2.25T"), 9ull << 38);
}

TEST(ParseByteSize, RejectsMalformedAndOverflow) {
  EXPECT_FALSE(ParseByteSize(""));
  EXPECT_FALSE(ParseByteSize("mb"));
  EXPECT_FALSE(ParseByteSize("-1"));
  EXPECT_FALSE(ParseByteSize("12xb"));
  EXPECT_FALSE(ParseByteSize("1.5"));  // a fraction of a byte
  EXPECT_FALSE(ParseByteSize("1.5b"));
  EXPECT_FALSE(ParseByteSize("1.gb"));
  EXPECT_FALSE(ParseByteSize(".5gb"));
  EXPECT_FALSE(ParseByteSize("99999999999999999999"));
  EXPECT_FALSE(ParseByteSize("17179869184tb"));  // 2^34 TiB overflows 64 bits
}

TEST(HumanBytes, Formats) {
  EXPECT_EQ(HumanBytes(512), "512B");
  EXPECT_EQ(HumanBytes(1536), "1.50K");
  EXPECT_EQ(HumanBytes(2ull << 30), "2.00G");
}

TEST(ParseInt64, RedisRules) {
  int64_t v;
  EXPECT_TRUE(ParseInt64("123", &v));
  EXPECT_EQ(v, 123);
  EXPECT_TRUE(ParseInt64("-5", &v));
  EXPECT_EQ(v, -5);
  EXPECT_FALSE(ParseInt64("", &v));
  EXPECT_FALSE(ParseInt64("+5", &v));
  EXPECT_FALSE(ParseInt64("5 ", &v));
  EXPECT_FALSE(ParseInt64("0x10", &v));
  EXPECT_FALSE(ParseInt64("9223372036854775808", &v));
}

}  // namespace
}  // namespace pion
