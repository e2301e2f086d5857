#include "proto/reply_builder.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

namespace pion::proto {
namespace {

std::string Drain(const ReplyBuffer& b) {
  iovec iov[256];
  int n = b.FillIovec(iov, 256);
  std::string out;
  for (int i = 0; i < n; ++i) out.append(static_cast<const char*>(iov[i].iov_base), iov[i].iov_len);
  return out;
}

TEST(ReplyBuilder, Resp2Encodings) {
  ReplyBuffer b;
  ReplyBuilder rb(&b, 2);
  rb.Ok();
  rb.Integer(-42);
  rb.Bulk("hi");
  rb.Null();
  rb.NullArray();
  rb.Map(1);
  rb.Bool(true);
  rb.Double(1.5);
  rb.ErrorLine("ERR bad\r\nthing");
  EXPECT_EQ(
      Drain(b),
      "+OK\r\n:-42\r\n$2\r\nhi\r\n$-1\r\n*-1\r\n*2\r\n:1\r\n$3\r\n1.5\r\n-ERR bad  thing\r\n");
  EXPECT_EQ(rb.errors(), 1);
}

TEST(ReplyBuilder, Resp3Encodings) {
  ReplyBuffer b;
  ReplyBuilder rb(&b, 3);
  rb.Null();
  rb.Map(2);
  rb.Set(0);
  rb.Bool(false);
  rb.Double(2.0);
  rb.Verbatim("abc");
  EXPECT_EQ(Drain(b), "_\r\n%2\r\n~0\r\n#f\r\n,2\r\n=7\r\ntxt:abc\r\n");
}

TEST(ReplyBuilder, MeasuredDoublesAreRoundedToWhatTheyMeasure) {
  ReplyBuffer b2, b3;
  ReplyBuilder rb2(&b2, 2), rb3(&b3, 3);
  for (ReplyBuilder* rb : {&rb2, &rb3}) {
    rb->Double(21211.101999999999, 3);  // micros from a nanosecond clock
    rb->Double(0.0312500001, 6);        // a fraction
    rb->Double(5.0, 3);                 // no trailing zeros, no dot
    rb->Double(-0.0000001, 3);          // not "-0"
  }
  EXPECT_EQ(Drain(b2), "$9\r\n21211.102\r\n$7\r\n0.03125\r\n$1\r\n5\r\n$1\r\n0\r\n");
  EXPECT_EQ(Drain(b3), ",21211.102\r\n,0.03125\r\n,5\r\n,0\r\n");
}

TEST(ReplyBuilder, LargeBulkIsReferencedNotCopied) {
  auto buf = CopyToBuffer(std::string(1 << 20, 'q')).value();
  ReplyBuffer b;
  ReplyBuilder rb(&b, 2);
  rb.BulkRef(buf);
  iovec iov[8];
  int n = b.FillIovec(iov, 8);
  ASSERT_EQ(n, 3);  // header, the stored bytes, CRLF
  EXPECT_EQ(iov[1].iov_base, buf->data());
  EXPECT_EQ(iov[1].iov_len, buf->size());
  EXPECT_EQ(buf.use_count(), 2);  // the reply keeps the stored bytes alive
  b.Clear();
  EXPECT_EQ(buf.use_count(), 1);
}

TEST(ReplyBuffer, PartialConsumeAndSplice) {
  auto buf = CopyToBuffer(std::string(20000, 'r')).value();
  ReplyBuffer a;
  a.Append("hello ");
  a.AppendRef(buf, buf->data(), buf->size());
  a.Append(" end");
  const std::string full = Drain(a);
  for (size_t cut : {size_t{3}, size_t{6}, size_t{100}, size_t{20006}, full.size() - 1}) {
    ReplyBuffer c;
    c.Append("hello ");
    c.AppendRef(buf, buf->data(), buf->size());
    c.Append(" end");
    c.Consume(cut);
    EXPECT_EQ(Drain(c), full.substr(cut)) << cut;
    EXPECT_EQ(c.size(), full.size() - cut);
    ReplyBuffer d;
    d.Append("pre:");
    d.Splice(std::move(c));
    EXPECT_EQ(Drain(d), "pre:" + full.substr(cut)) << cut;
    EXPECT_TRUE(c.empty());
  }
}

}  // namespace
}  // namespace pion::proto

namespace pion::proto {
namespace {

// A type byte and a little-endian uint64, as the binary encoding writes them.
std::string Typed(char type, uint64_t v) {
  std::string out(1, type);
  out.append(reinterpret_cast<const char*>(&v), 8);
  return out;
}

TEST(ReplyBuilder, BinaryEncodingIsTypedAndLengthPrefixed) {
  ReplyBuffer b;
  ReplyBuilder rb(&b, kBinaryReplies);
  EXPECT_TRUE(rb.binary());
  EXPECT_EQ(rb.version(), kBinaryReplies);
  rb.Ok();
  rb.Integer(-2);
  rb.Bulk(std::string("a\r\nb", 4));  // binary-safe: no CRLF framing
  rb.Null();
  rb.Map(1);
  rb.Bool(true);
  rb.Double(1.5);
  rb.ErrorLine("MISS gone\r\n");  // kept verbatim: the length frames it
  const double d = 1.5;
  uint64_t dbits;
  std::memcpy(&dbits, &d, 8);
  std::string want = Typed('+', 2) + "OK";
  want += Typed(':', static_cast<uint64_t>(-2));
  want += Typed('$', 4);
  want.append("a\r\nb", 4);
  want += '_';
  want += Typed('%', 1);
  want.append("#\x01", 2);
  want += Typed(',', dbits);
  want += Typed('-', 11);
  want += "MISS gone\r\n";
  EXPECT_EQ(Drain(b), want);
  EXPECT_EQ(rb.errors(), 1);
}

TEST(ReplyBuilder, BinaryLargeBulkIsReferencedWithoutTrailer) {
  auto buf = CopyToBuffer(std::string(1 << 20, 'q')).value();
  ReplyBuffer b;
  ReplyBuilder rb(&b, kBinaryReplies);
  rb.BulkRef(buf);
  iovec iov[8];
  ASSERT_EQ(b.FillIovec(iov, 8), 2);  // type+length, then the stored bytes
  EXPECT_EQ(iov[1].iov_base, buf->data());
  EXPECT_EQ(b.size(), 9u + buf->size());
  EXPECT_EQ(std::string(static_cast<const char*>(iov[0].iov_base), 9), Typed('$', buf->size()));
}

TEST(ReplyBuffer, PeekCopiesAcrossChunksAfterConsume) {
  auto buf = CopyToBuffer(std::string(20000, 'r')).value();
  ReplyBuffer a;
  a.Append("hey");
  a.AppendRef(buf, buf->data(), buf->size());
  a.Consume(1);
  char out[6];
  ASSERT_EQ(a.Peek(out, sizeof(out)), 6u);
  EXPECT_EQ(std::string(out, 6), "eyrrrr");
}

}  // namespace
}  // namespace pion::proto
