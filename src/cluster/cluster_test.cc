// Key slots against Redis' own vectors, the etcd gateway's JSON and base64, and the leader's
// slot-map rules (fail-over, replica placement, rebalancing) without etcd.
#include <gtest/gtest.h>

#include "cluster/json.h"
#include "cluster/key_slot.h"
#include "cluster/slot_map.h"

namespace pion::cluster {
namespace {

TEST(KeySlot, MatchesRedis) {
  EXPECT_EQ(Crc16("123456789"), 0x31C3);  // the check value in Redis' crc16.c
  EXPECT_EQ(KeySlot("foo"), 12182);       // redis-cli CLUSTER KEYSLOT foo
  EXPECT_EQ(KeySlot("somekey"), 11058);
  EXPECT_EQ(KeySlot(""), 0);
}

TEST(KeySlot, HashTags) {
  EXPECT_EQ(KeySlot("{user1000}.following"), KeySlot("user1000"));
  EXPECT_EQ(KeySlot("{doc42}_pk"), KeySlot("{doc42}_pv"));
  EXPECT_EQ(KeySlot("{doc42}_pk"), KeySlot("{doc42}"));
  EXPECT_EQ(HashTagOf("foo{}{bar}"), "foo{}{bar}");  // an empty first tag: the whole key
  EXPECT_EQ(HashTagOf("foo{{bar}}zap"), "{bar");     // from the first '{' to the first '}'
  EXPECT_EQ(HashTagOf("foo{bar}{zap}"), "bar");
  EXPECT_EQ(HashTagOf("no}tag{"), "no}tag{");
}

TEST(Json, ParsesEtcdReplies) {
  auto j = ParseJson(R"({"header":{"revision":"12"},"kvs":[{"key":"YQ==","value":"Yg==",
    "mod_revision":"7","lease":"694d7e"}],"count":"1","more":false, "s":"a\"\\\u0041"})");
  ASSERT_TRUE(j.ok()) << j.status().message();
  EXPECT_EQ(j.value()["header"]["revision"].Int(), 12);
  EXPECT_EQ(j.value()["kvs"].items.size(), 1u);
  EXPECT_EQ(j.value()["kvs"].items[0]["mod_revision"].Int(), 7);
  EXPECT_EQ(j.value()["kvs"].items[0]["lease"].Int(-1), -1);  // not a decimal number
  EXPECT_EQ(j.value()["s"].text, "a\"\\A");
  EXPECT_TRUE(j.value()["absent"].is_null());
  EXPECT_FALSE(ParseJson("{\"a\":}").ok());
  EXPECT_FALSE(ParseJson("[1,2").ok());
  EXPECT_FALSE(ParseJson("{} x").ok());
}

TEST(Json, Base64RoundTrips) {
  for (const std::string& s :
       std::vector<std::string>{"", "a", "ab", "abc", "abcd", std::string("\0\xff\x10", 3)}) {
    auto d = Base64Decode(Base64Encode(s));
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(d.value(), s);
  }
  EXPECT_EQ(Base64Encode("/pion/x"), "L3Bpb24veA==");
  EXPECT_FALSE(Base64Decode("abc").ok());
  EXPECT_FALSE(Base64Decode("ab!=").ok());
  EXPECT_EQ(JsonQuote("a\"\n"), "\"a\\\"\\u000a\"");
}

std::vector<NodeInfo> Nodes(std::initializer_list<const char*> ids) {
  std::vector<NodeInfo> out;
  int port = 7000;
  for (const char* id : ids) out.push_back({id, "127.0.0.1:" + std::to_string(port++), port});
  return out;
}

SlotMap Settle(SlotMap m, const std::vector<NodeInfo>& live, int replicas) {
  for (int round = 0; round < 10; ++round) {
    auto next = Reconcile(m, live, replicas, nullptr);
    if (!next) return m;
    m = *next;
    for (int i = 0; i < static_cast<int>(m.nodes.size()); ++i) {
      std::vector<int> moving;
      for (int s = 0; s < kSlots; ++s) {
        if (m.moving_from[s] == i) moving.push_back(s);
      }
      if (!moving.empty()) m = FinishMoves(m, i, moving);
    }
  }
  ADD_FAILURE() << "the map did not settle in 10 rounds";
  return m;
}

TEST(SlotMap, FirstNodeTakesEverythingThenSharesEvenly) {
  auto one = Reconcile(SlotMap{}, Nodes({"a"}), 1, nullptr);
  ASSERT_TRUE(one);
  EXPECT_EQ(one->SlotsOf(0), kSlots);
  EXPECT_TRUE(one->replicas[0].empty());                    // nobody to copy to
  EXPECT_FALSE(Reconcile(*one, Nodes({"a"}), 1, nullptr));  // nothing more to do

  auto three = Reconcile(*one, Nodes({"a", "b", "c"}), 1, nullptr);
  ASSERT_TRUE(three);
  EXPECT_EQ(three->epoch, one->epoch + 1);
  // The new owners have their slots at once; their keys are still coming from a.
  EXPECT_EQ(three->SlotsOf(0), 5462);
  EXPECT_EQ(three->SlotsOf(1), 5461);
  EXPECT_EQ(three->SlotsOf(2), 5461);
  int from_a = 0;
  for (int s = 0; s < kSlots; ++s) from_a += three->moving_from[s] == 0;
  EXPECT_EQ(from_a, 2 * 5461);
  EXPECT_EQ(three->replicas[0], std::vector<int16_t>{1});
  EXPECT_EQ(three->replicas[2], std::vector<int16_t>{0});
  // No second plan while slots move.
  EXPECT_FALSE(Reconcile(*three, Nodes({"a", "b", "c"}), 1, nullptr));

  SlotMap settled = Settle(*one, Nodes({"a", "b", "c"}), 1);
  EXPECT_EQ(settled.SlotsOf(0), 5462);
  EXPECT_EQ(settled.SlotsOf(1), 5461);
  EXPECT_EQ(settled.SlotsOf(2), 5461);
  EXPECT_FALSE(settled.AnyMoving());
}

TEST(SlotMap, DeadOwnerFailsOverToItsReplica) {
  SlotMap m = Settle(SlotMap{}, Nodes({"a", "b", "c"}), 1);
  const int b_slots = m.SlotsOf(1);
  std::vector<std::string> why;
  auto next = Reconcile(m, Nodes({"a", "c"}), 1, &why);  // b's lease expired
  ASSERT_TRUE(next);
  ASSERT_EQ(next->nodes.size(), 2u);
  // b's replica was c: c owns b's slots now, nothing moves in the same step.
  EXPECT_EQ(next->SlotsOf(next->IndexOf("c")), m.SlotsOf(2) + b_slots);
  EXPECT_FALSE(next->AnyMoving());
  EXPECT_FALSE(why.empty());
  // b comes back (a new incarnation): it gets its share back at once, its keys following.
  auto back = Nodes({"a", "b", "c"});
  back[1].incarnation = 99;
  auto rejoin = Reconcile(*next, back, 1, nullptr);
  ASSERT_TRUE(rejoin);
  EXPECT_EQ(rejoin->nodes[1].incarnation, 99);
  EXPECT_EQ(rejoin->SlotsOf(1), 5461);
  for (int s = 0; s < kSlots; ++s) {
    if (rejoin->owner[s] == 1) {
      EXPECT_GE(rejoin->moving_from[s], 0);
    }
  }
}

TEST(SlotMap, MovesSurviveADeadEnd) {
  auto one = *Reconcile(SlotMap{}, Nodes({"a"}), 1, nullptr);
  auto three = *Reconcile(*Reconcile(one, Nodes({"a", "b"}), 1, nullptr), Nodes({"a", "b", "c"}), 1,
                          nullptr);
  // The new owner b dies while a's keys move to it: its replica c takes over the import.
  auto b_dead = Reconcile(three, Nodes({"a", "c"}), 1, nullptr);
  ASSERT_TRUE(b_dead);
  const int a = b_dead->IndexOf("a"), c = b_dead->IndexOf("c");
  EXPECT_EQ(b_dead->SlotsOf(a) + b_dead->SlotsOf(c), kSlots);
  for (int s = 0; s < kSlots; ++s) {
    if (three.owner[s] == 1) {
      EXPECT_EQ(b_dead->owner[s], c);
      EXPECT_EQ(b_dead->moving_from[s], a);
    }
  }
  // The source a dies: its replica (b, here) sends what a had saved; without one it stops.
  auto two = *Reconcile(one, Nodes({"a", "b"}), 1, nullptr);
  ASSERT_TRUE(two.AnyMoving());
  auto a_dead = Reconcile(two, Nodes({"b"}), 1, nullptr);
  ASSERT_TRUE(a_dead);
  EXPECT_EQ(a_dead->SlotsOf(0), kSlots);  // b: the only one
  EXPECT_FALSE(a_dead->AnyMoving());      // b was a's replica and is the owner
}

TEST(SlotMap, EncodeDecodeRoundTrips) {
  SlotMap m = *Reconcile(*Reconcile(SlotMap{}, Nodes({"a"}), 2, nullptr), Nodes({"a", "b", "c"}), 2,
                         nullptr);
  auto d = SlotMap::Decode(m.Encode());
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d.value().Encode(), m.Encode());
  EXPECT_EQ(d.value().replicas[0].size(), 2u);
  EXPECT_FALSE(SlotMap::Decode("pion-slotmap 2\n").ok());
  EXPECT_FALSE(SlotMap::Decode("pion-slotmap 1\nrange 0 10 nobody\n").ok());
  EXPECT_FALSE(SlotMap::Decode("pion-slotmap 1\nnode a 1:1 1\nrange 5 16384 a\n").ok());
}

}  // namespace
}  // namespace pion::cluster
