#include "server/config.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace pion::server {
namespace {

StatusOr<Config> Parse(std::vector<std::string> args, int* code = nullptr) {
  args.insert(args.begin(), "pion-server");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  int exit_code = 0;
  bool should_exit = false;
  auto c = ParseConfig(static_cast<int>(argv.size()), argv.data(), &exit_code, &should_exit);
  if (code) *code = should_exit ? exit_code : -1;
  return c;
}

TEST(Config, Defaults) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->bind, "127.0.0.1");
  EXPECT_EQ(c->port, 1974);
  EXPECT_EQ(c->metrics_port, 9174);
  EXPECT_EQ(c->dir, "./data");
  EXPECT_EQ(c->proto_max_bulk_len, 2ull << 30);
  EXPECT_TRUE(c->kvcache);
  EXPECT_GE(c->workers, 1);
}

TEST(Config, FlagsAndSizes) {
  auto c = Parse({"--port", "7000", "-w", "3", "--maxmemory", "512mb", "--proto-max-bulk-len",
                  "1gb", "--kvcache=off", "--requirepass", "s3cret"});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->port, 7000);
  EXPECT_EQ(c->workers, 3);
  EXPECT_EQ(c->maxmemory, 512ull << 20);
  EXPECT_EQ(c->proto_max_bulk_len, 1ull << 30);
  EXPECT_FALSE(c->kvcache);
  EXPECT_EQ(c->requirepass, "s3cret");
}

TEST(Config, PollUsDefaultsByCoreCount) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->poll_us, std::thread::hardware_concurrency() >= 8 ? 100 : 0);
  c = Parse({"--poll-us", "250"});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->poll_us, 250);
  c = Parse({"--poll-us", "0"});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->poll_us, 0);
  int code = 0;
  EXPECT_FALSE(Parse({"--poll-us", "-2"}, &code).ok());
  EXPECT_NE(code, 0);
}

TEST(Config, BadFlagsExitNonZero) {
  int code = 0;
  EXPECT_FALSE(Parse({"--port", "70000"}, &code).ok());
  EXPECT_NE(code, 0);
  EXPECT_FALSE(Parse({"--maxmemory", "lots"}, &code).ok());
  EXPECT_NE(code, 0);
  EXPECT_FALSE(Parse({"--no-such-flag"}, &code).ok());
  EXPECT_NE(code, 0);
  EXPECT_FALSE(Parse({"--kvcache=maybe"}, &code).ok());
}

TEST(Config, TomlFileWithCommandLineOverride) {
  std::string path = ::testing::TempDir() + "/pion_config_test.toml";
  {
    std::ofstream f(path);
    f << "port = 7100\nmaxmemory = \"64mb\"\nkvcache = false\nloglevel = \"warn\"\n";
  }
  auto c = Parse({"--config", path, "--port", "7200"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->port, 7200);  // command line wins
  EXPECT_EQ(c->maxmemory, 64ull << 20);
  EXPECT_FALSE(c->kvcache);
  EXPECT_EQ(c->loglevel, "warn");
  std::remove(path.c_str());
}

TEST(Config, BrokenTomlIsAnError) {
  std::string path = ::testing::TempDir() + "/pion_config_bad.toml";
  {
    std::ofstream f(path);
    f << "port = = 1\n";
  }
  auto c = Parse({"--config", path});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("cannot parse config file"), std::string::npos);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace pion::server
