#include "proto/resp_parser.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace pion::proto {
namespace {

// Feeds `input` to the parser in chunks of at most `chunk` bytes (through ReadSpan, as the
// connection does) and collects every command until the input is exhausted or an error.
struct Feed {
  std::vector<std::vector<std::string>> commands;
  std::vector<bool> first_arg_big;  // per command: was any argument read into its own Buffer
  RespParser::Result last = RespParser::Result::kNeedMore;
  std::string error;
};

Feed FeedAll(RespParser& p, const std::string& input, size_t chunk) {
  Feed f;
  size_t off = 0;
  CmdArgs args;
  while (true) {
    while (true) {
      auto r = p.Next(&args);
      f.last = r;
      if (r == RespParser::Result::kError) {
        f.error = p.error();
        return f;
      }
      if (r == RespParser::Result::kNeedMore) break;
      std::vector<std::string> cmd;
      bool big = false;
      for (size_t i = 0; i < args.size(); ++i) {
        cmd.emplace_back(args[i]);
        big = big || args.IsBuffer(i);
      }
      f.commands.push_back(cmd);
      f.first_arg_big.push_back(big);
    }
    if (off >= input.size()) return f;
    auto span = p.ReadSpan();
    size_t n = std::min({chunk, span.size(), input.size() - off});
    std::memcpy(span.data(), input.data() + off, n);
    p.CommitRead(n);
    off += n;
  }
}

Feed Parse(const std::string& input, size_t chunk = 1 << 20, ParserLimits limits = {}) {
  RespParser p;
  p.set_limits(limits);
  return FeedAll(p, input, chunk);
}

std::string Multibulk(const std::vector<std::string>& args) {
  std::string out = "*" + std::to_string(args.size()) + "\r\n";
  for (const auto& a : args) out += "$" + std::to_string(a.size()) + "\r\n" + a + "\r\n";
  return out;
}

TEST(RespParser, MultibulkAndInline) {
  auto f = Parse(Multibulk({"SET", "k", "v"}) + "PING\r\n" + "echo hello\n");
  ASSERT_EQ(f.commands.size(), 3u);
  EXPECT_EQ(f.commands[0], (std::vector<std::string>{"SET", "k", "v"}));
  EXPECT_EQ(f.commands[1], (std::vector<std::string>{"PING"}));
  EXPECT_EQ(f.commands[2], (std::vector<std::string>{"echo", "hello"}));
}

TEST(RespParser, EmptyRequestsAreSkipped) {
  auto f = Parse("*0\r\n*-1\r\n\r\n   \r\n" + Multibulk({"PING"}));
  ASSERT_EQ(f.commands.size(), 1u);
  EXPECT_EQ(f.commands[0][0], "PING");
}

TEST(RespParser, EverySplitPointGivesTheSameCommands) {
  std::string big(40000, 'x');  // above the big-argument threshold
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>('a' + i % 26);
  std::string input = Multibulk({"ECHO", "a\r\nb"}) + "PING\r\n" + Multibulk({"ECHO", big}) +
                      Multibulk({"X", ""}) + "set \"a b\" 'c'\r\n";
  auto expected = Parse(input).commands;
  ASSERT_EQ(expected.size(), 5u);
  for (size_t chunk : {1, 2, 3, 5, 7, 64, 4095, 4096, 4097, 40001}) {
    auto f = Parse(input, chunk);
    EXPECT_EQ(f.last, RespParser::Result::kNeedMore) << f.error;
    EXPECT_EQ(f.commands, expected) << "chunk " << chunk;
  }
  // Split at every single offset of a small pipeline.
  std::string small = Multibulk({"SET", "key", "value"}) + "PING\r\n" + Multibulk({"GET", "k"});
  for (size_t cut = 1; cut < small.size(); ++cut) {
    RespParser p;
    Feed f1 = FeedAll(p, small.substr(0, cut), 1 << 20);
    Feed f2 = FeedAll(p, small.substr(cut), 1 << 20);
    f1.commands.insert(f1.commands.end(), f2.commands.begin(), f2.commands.end());
    EXPECT_EQ(f1.commands.size(), 3u) << "cut " << cut;
  }
}

TEST(RespParser, LargeBulkIsReadIntoItsOwnBuffer) {
  std::string big(1 << 20, '\0');
  std::mt19937 rng(7);
  for (auto& c : big) c = static_cast<char>(rng());
  auto f = Parse(Multibulk({"ECHO", big}), 65536);
  ASSERT_EQ(f.commands.size(), 1u);
  EXPECT_TRUE(f.first_arg_big[0]);
  EXPECT_EQ(f.commands[0][1], big);
  auto small = Parse(Multibulk({"ECHO", "tiny"}));
  EXPECT_FALSE(small.first_arg_big[0]);
}

TEST(RespParser, LargeBulkBytesGoStraightToTheArgumentBuffer) {
  // After the header, ReadSpan must point into the argument's own buffer (zero extra copy).
  RespParser p;
  std::string header = "*2\r\n$4\r\nECHO\r\n$100000\r\n";
  auto span = p.ReadSpan();
  std::memcpy(span.data(), header.data(), header.size());
  p.CommitRead(header.size());
  CmdArgs args;
  ASSERT_EQ(p.Next(&args), RespParser::Result::kNeedMore);
  auto target = p.ReadSpan();
  EXPECT_EQ(target.size(), 100000u);
  std::memset(target.data(), 'z', target.size());
  p.CommitRead(target.size());
  span = p.ReadSpan();
  std::memcpy(span.data(), "\r\n", 2);
  p.CommitRead(2);
  ASSERT_EQ(p.Next(&args), RespParser::Result::kCommand);
  EXPECT_TRUE(args.IsBuffer(1));
  EXPECT_EQ(args[1], std::string(100000, 'z'));
  auto adopted = args.TakeBuffer(1);
  ASSERT_TRUE(adopted.ok());
  EXPECT_EQ(adopted.value()->data(), target.data());  // the very bytes received, not a copy
}

TEST(RespParser, InlineQuoting) {
  auto f = Parse("set \"a\\x41\\n\" 'it\\'s' \"\" plain\r\n");
  ASSERT_EQ(f.commands.size(), 1u);
  EXPECT_EQ(f.commands[0], (std::vector<std::string>{"set", "aA\n", "it's", "", "plain"}));
}

struct BadInput {
  const char* name;
  std::string input;
  const char* error;
};

void PrintTo(const BadInput& b, std::ostream* os) { *os << b.name; }

class RespParserErrors : public ::testing::TestWithParam<BadInput> {};

TEST_P(RespParserErrors, AnswersTheSpecificError) {
  ParserLimits limits;
  limits.max_bulk_len = 1 << 20;
  limits.max_multibulk_len = 1000;
  auto f = Parse(GetParam().input, 1 << 20, limits);
  EXPECT_EQ(f.last, RespParser::Result::kError) << GetParam().name;
  EXPECT_EQ(f.error, GetParam().error) << GetParam().name;
  // Byte-at-a-time delivery reaches the same verdict.
  auto g = Parse(GetParam().input, 1, limits);
  EXPECT_EQ(g.error, GetParam().error) << GetParam().name;
}

INSTANTIATE_TEST_SUITE_P(
    Malformed, RespParserErrors,
    ::testing::Values(
        BadInput{"mbulk_not_number", "*abc\r\n", "invalid multibulk length"},
        BadInput{"mbulk_too_many", "*1001\r\n", "invalid multibulk length"},
        BadInput{"mbulk_plus_sign", "*+1\r\n", "invalid multibulk length"},
        BadInput{"mbulk_empty_count", "*\r\n", "invalid multibulk length"},
        BadInput{"mbulk_trailing_space", "*1 \r\n", "invalid multibulk length"},
        BadInput{"expected_dollar", "*1\r\n:5\r\n", "expected '$', got ':'"},
        BadInput{"bulk_negative", "*1\r\n$-1\r\n", "invalid bulk length"},
        BadInput{"bulk_not_number", "*1\r\n$x\r\n", "invalid bulk length"},
        BadInput{"bulk_too_long", "*1\r\n$1048577\r\n", "invalid bulk length"},
        BadInput{"bulk_missing_crlf", "*1\r\n$3\r\nabcde\r\n", "expected CRLF after bulk data"},
        BadInput{"big_bulk_missing_crlf", "*1\r\n$40000\r\n" + std::string(40000, 'a') + "XY",
                 "expected CRLF after bulk data"},
        BadInput{"unbalanced_double", "set \"abc\r\n", "unbalanced quotes in request"},
        BadInput{"unbalanced_single", "set 'abc\r\n", "unbalanced quotes in request"},
        BadInput{"quote_then_text", "set \"a\"b\r\n", "unbalanced quotes in request"},
        BadInput{"inline_too_big", std::string(70000, 'a'), "too big inline request"},
        BadInput{"mbulk_count_too_big", "*" + std::string(70000, '1'),
                 "too big mbulk count string"},
        BadInput{"bulk_count_too_big", "*1\r\n$" + std::string(70000, '1'),
                 "too big bulk count string"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(RespParser, PreAuthCaps) {
  ParserLimits limits;
  limits.authenticated = false;
  std::vector<std::string> eleven(11, "x");
  EXPECT_EQ(Parse(Multibulk(eleven), 1 << 20, limits).error, "unauthenticated multibulk length");
  EXPECT_EQ(Parse(Multibulk({"AUTH", std::string(16385, 'p')}), 1 << 20, limits).error,
            "unauthenticated bulk length");
  std::string inline_many = "a b c d e f g h i j k\r\n";
  EXPECT_EQ(Parse(inline_many, 1 << 20, limits).error, "unauthenticated multibulk length");
  auto ok = Parse(Multibulk({"AUTH", "secret"}), 1 << 20, limits);
  EXPECT_EQ(ok.commands.size(), 1u);
}

TEST(RespParser, QueryBufferLimit) {
  ParserLimits limits;
  limits.query_buffer_limit = 100000;
  auto f =
      Parse(Multibulk({"ECHO", std::string(60000, 'a'), std::string(60000, 'b')}), 1 << 20, limits);
  EXPECT_EQ(f.last, RespParser::Result::kError);
  RespParser p;
  p.set_limits(limits);
  (void)FeedAll(p, "*3\r\n$4\r\nECHO\r\n$60000\r\n" + std::string(60000, 'a') + "\r\n$60000\r\n",
                1 << 20);
  EXPECT_EQ(p.reason(), RespParser::ErrorReason::kQueryBufferLimit);
}

TEST(RespParser, BufferedBytesCountsPartialCommand) {
  RespParser p;
  (void)FeedAll(p, "*2\r\n$4\r\nECHO\r\n$50000\r\nabc", 1 << 20);
  EXPECT_GE(p.buffered_bytes(), 50000u);
}

}  // namespace
}  // namespace pion::proto
