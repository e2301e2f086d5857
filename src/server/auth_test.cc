#include "server/auth.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

namespace pion::server {
namespace {

std::string WriteFile(const std::string& name, const std::string& text) {
  std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(UserTable, LoadsUsersAndTenants) {
  UserTable t;
  auto path = WriteFile("users_ok",
                        "# comment\nalice pw1 teamA\n\nbob pw2 teamB # trailing\n"
                        "carol pw3 teamA\n");
  ASSERT_TRUE(t.LoadFile(path).ok());
  auto a = t.Authenticate("alice", "pw1");
  auto b = t.Authenticate("bob", "pw2");
  auto c = t.Authenticate("carol", "pw3");
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(*a, *c);
  EXPECT_NE(*a, *b);
  EXPECT_NE(*a, kDefaultTenant);
  EXPECT_EQ(t.TenantName(*a), "teamA");
  EXPECT_FALSE(t.Authenticate("alice", "pw2"));
  EXPECT_FALSE(t.Authenticate("alice", "pw1x"));
  EXPECT_FALSE(t.Authenticate("nobody", "pw1"));
  std::remove(path.c_str());
}

TEST(UserTable, RejectsMalformedLines) {
  UserTable t;
  auto path = WriteFile("users_bad", "alice pw1\n");
  Status s = t.LoadFile(path);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("line 1"), std::string::npos);
  auto dup = WriteFile("users_dup", "a p t\na q t\n");
  EXPECT_FALSE(UserTable().LoadFile(dup).ok());
  EXPECT_FALSE(UserTable().LoadFile("/nonexistent/users").ok());
  std::remove(path.c_str());
  std::remove(dup.c_str());
}

TEST(UserTable, DefaultPasswordBindsDefaultTenant) {
  UserTable t;
  t.SetDefaultPassword("secret");
  auto d = t.Authenticate("default", "secret");
  ASSERT_TRUE(d);
  EXPECT_EQ(*d, kDefaultTenant);
}

}  // namespace
}  // namespace pion::server
