#include "proto/binary_frame.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/binary_commands.h"

namespace pion::proto::binary {
namespace {

template <typename T>
std::string Le(T v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(T));
}
std::string Str(std::string_view s) {
  return Le<uint16_t>(static_cast<uint16_t>(s.size())) + std::string(s);
}

std::string Frame(uint8_t cmd, const std::string& payload, uint64_t rid = 7, uint16_t flags = 0,
                  uint8_t version = kVersion, uint64_t len = ~0ull) {
  FrameHeader h;
  h.version = version;
  h.command = cmd;
  h.flags = flags;
  h.request_id = rid;
  h.payload_len = len == ~0ull ? payload.size() : len;
  std::string out(kHeaderSize, '\0');
  EncodeHeader(h, reinterpret_cast<uint8_t*>(out.data()));
  return out + payload;
}

struct Event {
  FrameParser::Result result;
  std::vector<std::string> args;
  uint64_t request_id;
  uint16_t status;
  std::string error;
};

// Feeds input in chunks through ReadSpan (as the connection does) and records every outcome.
std::vector<Event> FeedAll(FrameParser& p, const std::string& input, size_t chunk) {
  std::vector<Event> out;
  CmdArgs args;
  size_t off = 0;
  while (true) {
    auto r = p.Next(&args);
    if (r == FrameParser::Result::kNeedMore) {
      if (off >= input.size()) break;
      auto span = p.ReadSpan();
      size_t n = std::min({chunk, span.size(), input.size() - off});
      std::memcpy(span.data(), input.data() + off, n);
      p.CommitRead(n);
      off += n;
      continue;
    }
    Event e{r, {}, p.header().request_id, p.status(), p.error()};
    for (size_t i = 0; i < args.size(); ++i) e.args.emplace_back(args[i]);
    args.Clear();
    out.push_back(std::move(e));
    if (r == FrameParser::Result::kError) break;
  }
  return out;
}

using Args = std::vector<std::string>;

TEST(BinaryFrame, HeaderRoundTripsLittleEndian) {
  FrameHeader h;
  h.command = 0xA3;
  h.flags = 0x0102;
  h.status = 12;
  h.request_id = 0x1122334455667788ull;
  h.payload_len = 99;
  uint8_t b[kHeaderSize];
  EncodeHeader(h, b);
  EXPECT_EQ(b[0], 0x5E);
  EXPECT_EQ(b[1], 0xCA);
  EXPECT_EQ(b[8], 0x88);
  FrameHeader g;
  ASSERT_TRUE(DecodeHeader(b, &g));
  EXPECT_EQ(g.command, 0xA3);
  EXPECT_EQ(g.flags, 0x0102);
  EXPECT_EQ(g.status, 12);
  EXPECT_EQ(g.request_id, h.request_id);
  EXPECT_EQ(g.payload_len, 99u);
  b[0] = 0;
  EXPECT_FALSE(DecodeHeader(b, &g));
}

TEST(BinaryFrame, StatusOfErrorFollowsTheErrorKinds) {
  EXPECT_EQ(StatusOfError("MISS no attention session 's'"),
            static_cast<uint16_t>(ErrorKind::kMiss));
  EXPECT_EQ(StatusOfError("OOM command not allowed"), static_cast<uint16_t>(ErrorKind::kOom));
  EXPECT_EQ(StatusOfError("BUSY later"), static_cast<uint16_t>(ErrorKind::kBusy));
  EXPECT_EQ(StatusOfError("NOAUTH Authentication required."),
            static_cast<uint16_t>(ErrorKind::kNoAuth));
  EXPECT_EQ(StatusOfError("ERR bad"), static_cast<uint16_t>(ErrorKind::kErr));
  EXPECT_EQ(StatusOfError("SOMETHING else"), static_cast<uint16_t>(ErrorKind::kErr));
}

TEST(BinaryFrame, EveryCommandBecomesItsRespEquivalentAtAnyChunking) {
  const std::string keys(64, 'k'), vals(32, 'v'), q(16, 'q');
  const std::string stream =
      Frame(kLayerStore, Str("s1") + Le<uint32_t>(3) + "STATE", 1) +
      Frame(kLayerFetch, Str("s1") + Le<uint32_t>(3), 2) +
      Frame(kLayerDrop, Str("s1") + Le<int64_t>(-1), 3) +
      Frame(kLayerDrop, Str("s1") + Le<int64_t>(4), 4) + Frame(kPing, "", 5) +
      Frame(kPing, "hi", 6) + Frame(kAuth, Str("") + Str("pw"), 7) +
      Frame(kAuth, Str("alice") + Str("pw"), 8) +
      Frame(kAttendCreate,
            Str("a") + Le<uint32_t>(4) + Le<uint32_t>(2) + Le<uint32_t>(0) + Le<uint32_t>(0) +
                Le<uint8_t>(0),
            9) +
      Frame(kAttendCreate,
            Str("b") + Le<uint32_t>(4) + Le<uint32_t>(2) + Le<uint32_t>(8) + Le<uint32_t>(50) +
                Le<uint8_t>(2),
            10) +
      Frame(kAttendStore, Str("a") + Le<int64_t>(-1) + Le<uint64_t>(keys.size()) + keys + vals,
            11) +
      Frame(kAttendStore, Str("a") + Le<int64_t>(100) + Le<uint64_t>(keys.size()) + keys + vals,
            12) +
      Frame(kAttendFinalize, Str("a"), 13) +
      Frame(kAttendQuery, Str("a") + Le<uint32_t>(5) + Le<uint32_t>(0) + Le<uint8_t>(2) + q, 14) +
      Frame(kAttendQuery, Str("a") + Le<uint32_t>(5) + Le<uint32_t>(64) + Le<uint8_t>(1) + q, 15) +
      Frame(kAttendInfo, Str(""), 16) + Frame(kAttendInfo, Str("a"), 17) +
      Frame(kAttendDrop, Str("a"), 18);
  const std::vector<Args> want = {
      {"SSM.PREFIX.STORE", "s1", "3", "STATE"},
      {"SSM.PREFIX.FETCH", "s1", "3"},
      {"SSM.PREFIX.DROP", "s1"},
      {"SSM.PREFIX.DROP", "s1", "4"},
      {"PING"},
      {"PING", "hi"},
      {"AUTH", "pw"},
      {"AUTH", "alice", "pw"},
      {"ATTEND.CREATE", "a", "4", "2", "METRIC", "ip"},
      {"ATTEND.CREATE", "b", "4", "2", "M", "8", "EF_CONSTRUCTION", "50", "METRIC", "cos"},
      {"ATTEND.STORE", "a", keys, vals},
      {"ATTEND.STORE", "a", keys, vals, "100"},
      {"ATTEND.FINALIZE", "a"},
      {"ATTEND.QUERY", "a", "5", q, "EXACT"},
      {"ATTEND.QUERY", "a", "5", q, "EF", "64", "ATTEND"},
      {"ATTEND.INFO"},
      {"ATTEND.INFO", "a"},
      {"ATTEND.DROP", "a"},
  };
  for (size_t threshold : {size_t{16}, size_t{1} << 20}) {  // big payloads sliced / copied
    for (size_t chunk : {size_t{1}, size_t{5}, size_t{4096}}) {
      FrameParser p;
      ParserLimits l;
      l.big_arg_threshold = threshold;
      p.set_limits(l);
      auto ev = FeedAll(p, stream, chunk);
      ASSERT_EQ(ev.size(), want.size()) << chunk;
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(ev[i].result, FrameParser::Result::kCommand) << i << ": " << ev[i].error;
        EXPECT_EQ(ev[i].args, want[i]) << "frame " << i << " chunk " << chunk;
        EXPECT_EQ(ev[i].request_id, i + 1);
      }
    }
  }
}

TEST(BinaryFrame, LargePayloadFieldsAreSlicesOfOneBuffer) {
  const std::string keys(1 << 16, 'k'), vals(1 << 15, 'v');
  const std::string f =
      Frame(kAttendStore, Str("a") + Le<int64_t>(-1) + Le<uint64_t>(keys.size()) + keys + vals);
  FrameParser p;
  size_t off = 0;
  CmdArgs args;
  while (p.Next(&args) == FrameParser::Result::kNeedMore) {
    auto span = p.ReadSpan();
    size_t n = std::min(span.size(), f.size() - off);
    std::memcpy(span.data(), f.data() + off, n);
    p.CommitRead(n);
    off += n;
  }
  ASSERT_EQ(args.size(), 4u);
  EXPECT_EQ(args[2], keys);
  EXPECT_EQ(args[3], vals);
  EXPECT_EQ(args[2].data() + keys.size(), args[3].data());  // adjacent in the payload Buffer
  EXPECT_FALSE(args.IsBuffer(2));                           // a slice: TakeBuffer copies
  auto b = args.TakeBuffer(3);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b.value()->view(), vals);
}

TEST(BinaryFrame, RejectedFramesAreConsumedAndTheStreamGoesOn) {
  const std::string stream =
      Frame(0x7F, std::string(5000, 'x'), 1) +                              // unknown command
      Frame(kPing, "", 2, /*flags=*/1) +                                    // flags set
      Frame(kAttendFinalize, Le<uint16_t>(9) + "ab", 3) +                   // field past the end
      Frame(kAttendFinalize, Str("a") + "zz", 4) +                          // bytes after fields
      Frame(kAttendCreate, Str("a") + std::string(16, '\0') + "\x07", 5) +  // metric 7
      Frame(kLayerDrop, Str("s") + Le<int64_t>(-5), 6) +                    // layer -5
      Frame(kAttendQuery, Str("a") + Le<uint32_t>(1) + Le<uint32_t>(0) + "\x04" + "q", 7) +
      Frame(kPing, "", 8);
  FrameParser p;
  auto ev = FeedAll(p, stream, 3);
  ASSERT_EQ(ev.size(), 8u);
  const uint16_t kBad = static_cast<uint16_t>(FrameStatus::kBadFrame);
  EXPECT_EQ(ev[0].status, static_cast<uint16_t>(FrameStatus::kUnknownCommand));
  EXPECT_EQ(ev[0].error, "unknown command 0x7F");
  EXPECT_EQ(ev[1].status, kBad);
  EXPECT_EQ(ev[1].error, "flags must be 0 in protocol version 1, got 0x0001");
  EXPECT_EQ(ev[2].error,
            "ATTEND.FINALIZE: payload truncated: field 'sid' needs 9 bytes at offset 2, payload "
            "has 4");
  EXPECT_EQ(ev[3].error, "ATTEND.FINALIZE: payload has 2 bytes after its fields");
  EXPECT_EQ(ev[4].error, "ATTEND.CREATE: metric must be 0 (ip), 1 (l2) or 2 (cos), got 7");
  EXPECT_EQ(ev[5].error, "LAYER.DROP: layer must be -1 (all layers) or a layer index");
  EXPECT_EQ(ev[6].error, "ATTEND.QUERY: options has unknown bits set: 4");
  for (size_t i = 0; i < 7; ++i) {
    EXPECT_EQ(ev[i].result, FrameParser::Result::kReject) << i;
    EXPECT_EQ(ev[i].request_id, i + 1);
    if (i > 0) EXPECT_EQ(ev[i].status, kBad) << i;
  }
  EXPECT_EQ(ev[7].result, FrameParser::Result::kCommand);
  EXPECT_EQ(ev[7].args, Args{"PING"});
}

TEST(BinaryFrame, FatalErrorsStopTheStream) {
  struct Case {
    std::string input;
    FrameStatus status;
    std::string error;
  };
  std::string bad_magic = Frame(kPing, "");
  bad_magic[0] = 'P';  // e.g. a RESP client on the binary port
  const Case cases[] = {
      {bad_magic, FrameStatus::kBadFrame,
       "bad magic 0xCA50 (frames start with 0xCA5E, bytes 5E CA)"},
      {Frame(kPing, "", 1, 0, /*version=*/2), FrameStatus::kBadVersion,
       "unsupported protocol version 2 (this server speaks version 1)"},
      {Frame(kLayerStore, "", 1, 0, kVersion, /*len=*/1ull << 40), FrameStatus::kTooLarge,
       "frame payload of 1099511627776 bytes exceeds the client query buffer limit of "
       "4294967296"},
  };
  for (const Case& c : cases) {
    FrameParser p;
    auto ev = FeedAll(p, c.input + Frame(kPing, ""), 64);
    ASSERT_EQ(ev.size(), 1u) << c.error;
    EXPECT_EQ(ev[0].result, FrameParser::Result::kError);
    EXPECT_EQ(ev[0].status, static_cast<uint16_t>(c.status));
    EXPECT_EQ(ev[0].error, c.error);
  }
}

TEST(BinaryFrame, BeforeAuthOnlySmallPayloadsAndBlobsUnderTheBulkLimit) {
  ParserLimits l;
  l.authenticated = false;
  FrameParser p;
  p.set_limits(l);
  auto ev = FeedAll(p, Frame(kLayerStore, std::string(20000, 'x')), 4096);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].error, "frame payload of 20000 bytes exceeds the limit of 16384 before AUTH");

  ParserLimits m;
  m.max_bulk_len = 10;
  FrameParser q;
  q.set_limits(m);
  ev = FeedAll(q, Frame(kLayerStore, Str("s") + Le<uint32_t>(0) + std::string(11, 'x')), 4096);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].result, FrameParser::Result::kReject);
  EXPECT_EQ(ev[0].error, "LAYER.STORE: state of 11 bytes exceeds proto-max-bulk-len (10)");
}

}  // namespace
}  // namespace pion::proto::binary
