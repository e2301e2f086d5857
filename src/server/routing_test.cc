// Shard routing and the bounded shard inbox.
#include <gtest/gtest.h>

#include <set>

#include "families/families.h"
#include "server/server.h"

namespace pion::server {
namespace {

std::unique_ptr<Server> MakeServer(int workers) {
  Config c;
  c.bind = "127.0.0.1";
  c.port = 0;  // any free port
  c.metrics_port = 0;
  c.workers = workers;
  auto s = std::make_unique<Server>(c);
  families::RegisterAll(*s);
  Status st = s->Init();
  EXPECT_TRUE(st.ok()) << st.message();
  return s;
}

TEST(Routing, KeysSpreadOverAllShardsDeterministically) {
  auto s = MakeServer(4);
  std::vector<int> count(4);
  for (int i = 0; i < 4000; ++i) {
    std::string key = "slot:" + std::to_string(i);
    int owner = s->OwnerOf(0, key);
    ASSERT_GE(owner, 0);
    ASSERT_LT(owner, 4);
    EXPECT_EQ(owner, s->OwnerOf(0, key));
    ++count[owner];
  }
  for (int c : count) EXPECT_GT(c, 800);  // roughly uniform (expected 1000)
}

TEST(Routing, TenantIsPartOfTheHash) {
  auto s = MakeServer(8);
  int differ = 0;
  for (int i = 0; i < 200; ++i) {
    std::string key = "k" + std::to_string(i);
    if (s->OwnerOf(1, key) != s->OwnerOf(2, key)) ++differ;
  }
  EXPECT_GT(differ, 100);
}

TEST(Routing, HashTagsColocateKeys) {
  auto s = MakeServer(8);
  for (int i = 0; i < 100; ++i) {
    std::string ns = "prefix" + std::to_string(i);
    EXPECT_EQ(s->OwnerOf(0, "{" + ns + "}_pk"), s->OwnerOf(0, "{" + ns + "}_pv"));
    EXPECT_EQ(s->OwnerOf(0, "{" + ns + "}_pk"), s->OwnerOf(0, ns));
  }
  // An empty tag "{}" is not a tag: the whole key is hashed.
  std::set<int> owners;
  for (int i = 0; i < 64; ++i) owners.insert(s->OwnerOf(0, "{}" + std::to_string(i)));
  EXPECT_GT(owners.size(), 1u);
}

TEST(Routing, SingleShardOwnsEverything) {
  auto s = MakeServer(1);
  EXPECT_EQ(s->OwnerOf(0, "anything"), 0);
  EXPECT_EQ(s->OwnerOf(7, "else"), 0);
}

TEST(ShardInbox, FullInboxRefusesDataTasksButNotControl) {
  Shard shard(nullptr, 0, -1, -1, -1, 1, /*queue_depth=*/2);
  int ran = 0;
  EXPECT_TRUE(shard.Post([&](Shard&) { ++ran; }));
  EXPECT_TRUE(shard.Post([&](Shard&) { ++ran; }));
  EXPECT_FALSE(shard.Post([&](Shard&) { ++ran; }));  // -> the client gets -BUSY
  EXPECT_EQ(shard.queued(), 2u);
  shard.PostControl([&](Shard&) { ++ran; });  // replies are never refused
  shard.set_queue_depth(3);
  EXPECT_TRUE(shard.Post([&](Shard&) { ++ran; }));
}

}  // namespace
}  // namespace pion::server
