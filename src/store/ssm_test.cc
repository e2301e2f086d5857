#include <gtest/gtest.h>

#include "residency/engine.h"
#include "store/ssm_serialization.h"
#include "store/ssm_store.h"

namespace pion::store {
namespace {

TEST(SsmSerialization, RoundTripMatchesTheSeedLayout) {
  std::vector<SsmArray> in(2);
  in[0].shape = {2, 3};
  in[0].dtype_code = 1;
  in[0].values = {1, 2, 3, 4, 5, -6.5f};
  in[1].shape = {4};
  in[1].values = {0.25f, 0, -1, 1e30f};
  std::string blob = SerializeSsmState(in);
  // version, n_arrays, ndim, 2 dims, dtype, 6 values, ndim, 1 dim, dtype, 4 values
  EXPECT_EQ(blob.size(), 4u * (2 + 1 + 2 + 1 + 6 + 1 + 1 + 1 + 4));
  EXPECT_EQ(blob.substr(0, 8), std::string("\x01\0\0\0\x02\0\0\0", 8));
  auto out = ParseSsmState(blob);
  ASSERT_TRUE(out.ok()) << out.status().message();
  ASSERT_EQ(out->size(), 2u);
  EXPECT_EQ((*out)[0].shape, in[0].shape);
  EXPECT_EQ((*out)[0].dtype_code, 1u);
  EXPECT_EQ((*out)[0].values, in[0].values);
  EXPECT_EQ((*out)[1].values, in[1].values);
}

// An array with a zero dimension holds no values, and round-trips as such.
TEST(SsmSerialization, ZeroDimensionArrayRoundTrips) {
  std::vector<SsmArray> in(2);
  in[0].shape = {0, 4};
  in[1].shape = {2};
  in[1].values = {1.5f, -2};
  auto out = ParseSsmState(SerializeSsmState(in));
  ASSERT_TRUE(out.ok()) << out.status().message();
  ASSERT_EQ(out->size(), 2u);
  EXPECT_EQ((*out)[0].shape, in[0].shape);
  EXPECT_TRUE((*out)[0].values.empty());
  EXPECT_EQ((*out)[1].values, in[1].values);
}

TEST(SsmSerialization, MalformedBlobsAreNamed) {
  EXPECT_FALSE(ParseSsmState("abc").ok());
  std::string bad_version("\x02\0\0\0\0\0\0\0", 8);
  EXPECT_EQ(ParseSsmState(bad_version).status().message(), "SSM state version 2, expected 1");
  std::vector<SsmArray> one(1);
  one[0].shape = {8};
  one[0].values.assign(8, 1.f);
  std::string blob = SerializeSsmState(one);
  EXPECT_NE(
      ParseSsmState(blob.substr(0, blob.size() - 4)).status().message().find("needs 32 bytes"),
      std::string::npos);
  EXPECT_NE(ParseSsmState(blob + "x").status().message().find("trailing"), std::string::npos);
}

TEST(SsmStore, PutReplaceDropAndGauges) {
  residency::Engine engine({});
  auto blob = [&](std::string bytes) {
    return engine.CreateInHost(residency::Family::kSsm, {CopyToBuffer(bytes).value()}, nullptr);
  };
  SsmStore s;
  TenantKey sid{0, "seq"};
  s.Put(sid, 0, blob(std::string(40, 'a')));
  s.Put(sid, 1, blob(std::string(40, 'b')));
  BufferRef held = s.Blob(sid, 0)->HostBlock(0);
  s.Put(sid, 0, blob(std::string(10, 'z')));      // replace
  EXPECT_EQ(held->view(), std::string(40, 'a'));  // the old blob lives while referenced
  EXPECT_EQ(s.Blob(sid, 0)->HostBlock(0)->view(), std::string(10, 'z'));
  EXPECT_EQ(s.Total().bytes, 50u);
  EXPECT_EQ(s.Blob(TenantKey{1, "seq"}, 0), nullptr);  // other tenant
  EXPECT_EQ(s.Drop(sid, 7), 0u);
  EXPECT_EQ(s.Drop(sid, 1), 1u);
  EXPECT_EQ(s.Find(sid)->writes, 4u);  // three puts and a layer drop
  EXPECT_EQ(s.Drop(sid, std::nullopt), 1u);
  EXPECT_EQ(s.Drop(sid, std::nullopt), 0u);
  EXPECT_EQ(s.Total().blobs, 0u);
  EXPECT_EQ(s.Total().sessions, 0u);
  EXPECT_EQ(s.NextVersion(sid), 1u);
  s.NoteVersion(sid, 7);
  EXPECT_EQ(s.NextVersion(sid), 8u);
}

}  // namespace
}  // namespace pion::store
