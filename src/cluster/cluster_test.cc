// Key slots against Redis' own vectors, the etcd gateway's JSON, base64 and message stream, and
// the leader's slot-map rules (fail-over, replica placement, rebalancing) without etcd.
#include <gtest/gtest.h>

#include "cluster/etcd_json.h"
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

TEST(EtcdJson, ReadsGatewayReplies) {
  // etcd writes int64 as strings and omits zero values (here "lease" and "value"), and a
  // "lease" that is no decimal number reads as the fallback.
  auto j = etcd_json::Parse(R"({"header":{"revision":"12"},"kvs":[{"key":"YQ==",
    "mod_revision":"7","lease":"694d7e","version":3}],"count":"1","more":false,"s":"a\"\\\u0041"})");
  ASSERT_TRUE(j.ok()) << j.status().message();
  EXPECT_EQ(etcd_json::Int(etcd_json::Member(j.value(), "header"), "revision"), 12);
  const etcd_json::Json& kv = etcd_json::Member(j.value(), "kvs")[0];
  EXPECT_EQ(etcd_json::Int(kv, "mod_revision"), 7);
  EXPECT_EQ(etcd_json::Int(kv, "version"), 3);
  EXPECT_EQ(etcd_json::Int(kv, "lease", -1), -1);
  EXPECT_EQ(etcd_json::Int(kv, "create_revision"), 0);
  EXPECT_EQ(etcd_json::Text(kv, "value"), "");
  EXPECT_EQ(etcd_json::Text(j.value(), "s"), "a\"\\A");
  EXPECT_FALSE(etcd_json::Bool(j.value(), "more"));
  EXPECT_FALSE(etcd_json::Bool(j.value(), "absent"));
  EXPECT_TRUE(etcd_json::Member(j.value(), "absent").is_null());
  EXPECT_TRUE(etcd_json::Member(kv["key"], "x").is_null());  // not an object
  EXPECT_FALSE(etcd_json::Parse("{\"a\":}").ok());
  EXPECT_FALSE(etcd_json::Parse("[1,2").ok());
  EXPECT_FALSE(etcd_json::Parse("{} x").ok());
  EXPECT_EQ(etcd_json::Dump({{"key", "L3Bpb24veA=="}, {"lease", "7"}}),
            R"({"key":"L3Bpb24veA==","lease":"7"})");
}

TEST(EtcdJson, Base64RoundTripsAndRefusesMalformedText) {
  std::string all;
  for (int c = 0; c < 256; ++c) all.push_back(static_cast<char>(c));
  for (const std::string& s :
       std::vector<std::string>{"", "a", "ab", "abc", "abcd", std::string("\0\xff\x10", 3), all}) {
    auto d = etcd_json::Base64Decode(etcd_json::Base64Encode(s));
    ASSERT_TRUE(d.ok()) << d.status().message();
    EXPECT_EQ(d.value(), s);
  }
  EXPECT_EQ(etcd_json::Base64Encode("/pion/x"), "L3Bpb24veA==");  // RFC 4648's alphabet
  EXPECT_EQ(etcd_json::Base64Encode(std::string("\xfb\xff", 2)), "+/8=");
  EXPECT_EQ(etcd_json::Base64Decode("L3Bpb24veA==").value(), "/pion/x");
  EXPECT_EQ(etcd_json::Base64Decode("YWI=").value(), "ab");
  EXPECT_FALSE(etcd_json::Base64Decode("abc").ok());   // length
  EXPECT_FALSE(etcd_json::Base64Decode("ab!=").ok());  // alphabet
  EXPECT_FALSE(etcd_json::Base64Decode("a=bc").ok());  // padding inside
  EXPECT_FALSE(etcd_json::Base64Decode("a===").ok());  // three of padding
  EXPECT_FALSE(etcd_json::Base64Decode(" YWI").ok());  // whitespace OpenSSL would skip
  EXPECT_FALSE(etcd_json::Base64Decode("YW-_").ok());  // the URL-safe alphabet
}

TEST(EtcdJson, MessageStreamSplitsMessagesCutAnywhere) {
  const std::string stream =
      "{\"result\":{\"created\":true}}\n{\"result\":{\"events\":[{\"kv\":{}}]}}\r\n\n"
      "{\"result\":{\"events\":[]}}\n";
  const std::vector<std::string> want = {R"({"result":{"created":true}})",
                                         R"({"result":{"events":[{"kv":{}}]}})",
                                         R"({"result":{"events":[]}})"};
  for (size_t piece = 1; piece <= stream.size(); ++piece) {
    etcd_json::MessageStream s;
    std::vector<std::string> got;
    for (size_t at = 0; at < stream.size(); at += piece) {
      ASSERT_TRUE(s.Feed(std::string_view(stream).substr(at, piece), [&](std::string_view m) {
        got.emplace_back(m);
        return true;
      }));
    }
    EXPECT_EQ(got, want) << "pieces of " << piece;
    EXPECT_EQ(s.pending(), 0u);
  }
  // A callback that stops the stream: the rest stays unread.
  etcd_json::MessageStream s;
  int seen = 0;
  EXPECT_FALSE(s.Feed("a\nb\nc", [&](std::string_view) { return ++seen < 1; }));
  EXPECT_EQ(seen, 1);
  EXPECT_EQ(s.pending(), 3u);  // "b\nc"
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
