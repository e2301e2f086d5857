// RowView against the codecs themselves: a column range decodes to exactly the full row's values
// in every format where RAW slicing is allowed, AS equals the target encoder over the decoded
// values bit for bit, the same codec is passed through, and block-splitting ranges are refused.
#include "store/codec/row_view.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace pion::codec {
namespace {

std::vector<float> Rows(size_t n, uint32_t dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  std::vector<float> x(n * dim);
  for (auto& v : x) v = g(rng);
  return x;
}

constexpr Format kAll[] = {Format::kFp32,   Format::kFp16,   Format::kBf16,
                           Format::kInt8,   Format::kTurbo4, Format::kTurbo3,
                           Format::kTurbo2, Format::kFp8,    Format::kFp8E5m2};

TEST(RowView, RawHeadsDecodeToTheFullRowsValues) {
  const uint32_t dim = 8 * 128, n = 70;  // 8 heads of 128: turbo blocks and int8 blocks align
  const auto x = Rows(n, dim, 1);
  for (Format f : kAll) {
    const RowCodec c = RowCodec::Create(f, dim).value();
    std::vector<uint8_t> stored(n * c.row_bytes());
    c.Encode(x.data(), n, stored.data());
    std::vector<float> full(n * dim);
    c.Decode(stored.data(), n, full.data());
    for (auto [first, count] : {std::pair{0u, 2u}, {2u, 2u}, {6u, 2u}, {3u, 1u}}) {
      auto v = RowView::Create(c, first * 128, count * 128, RowView::Output::kStored);
      ASSERT_TRUE(v.ok()) << FormatName(f) << ": " << v.status().message();
      std::vector<uint8_t> out(n * v->out_row_bytes());
      std::vector<float> scratch;
      v->Apply(stored.data(), n, out.data(), &scratch);
      // A reader copying StoredParts out of the stored rows gets exactly these rows (the SHM
      // reply's row_parts).
      const auto parts = v->StoredParts();
      ASSERT_FALSE(parts.empty()) << FormatName(f);
      std::vector<uint8_t> copied;
      for (size_t r = 0; r < n; ++r) {
        for (const auto& p : parts) {
          ASSERT_LE(p.offset + p.length, c.row_bytes()) << FormatName(f);
          const uint8_t* src = stored.data() + r * c.row_bytes() + p.offset;
          copied.insert(copied.end(), src, src + p.length);
        }
      }
      EXPECT_EQ(copied, out) << FormatName(f) << " heads " << first << "+" << count;
      // Only the heads' share of the bytes moves (fp8: plus the row's scale).
      EXPECT_LE(v->out_row_bytes(), c.row_bytes() * count / 8 + 4) << FormatName(f);
      std::vector<float> got(n * count * 128);
      v->out_codec().Decode(out.data(), n, got.data());
      for (size_t r = 0; r < n; ++r) {
        ASSERT_EQ(0, std::memcmp(&got[r * count * 128], &full[r * dim + first * 128],
                                 count * 128 * sizeof(float)))
            << FormatName(f) << " heads " << first << "+" << count << " row " << r;
      }
      // Decoded (no RAW): the same floats.
      auto d = RowView::Create(c, first * 128, count * 128, RowView::Output::kFp32);
      std::vector<uint8_t> fl(n * d->out_row_bytes());
      d->Apply(stored.data(), n, fl.data(), &scratch);
      EXPECT_EQ(0, std::memcmp(fl.data(), got.data(), fl.size()));
      EXPECT_TRUE(d->StoredParts().empty());  // decoded values are no stored bytes
    }
  }
}

TEST(RowView, AsEqualsTheTargetEncoderBitForBit) {
  const uint32_t dim = 4 * 64, n = 65;
  const auto x = Rows(n, dim, 2);
  for (Format from : kAll) {
    const RowCodec src = RowCodec::Create(from, dim).value();
    std::vector<uint8_t> stored(n * src.row_bytes());
    src.Encode(x.data(), n, stored.data());
    std::vector<float> decoded(n * dim);
    src.Decode(stored.data(), n, decoded.data());
    for (Format to : {Format::kFp32, Format::kFp16, Format::kBf16, Format::kFp8, Format::kInt8,
                      Format::kFp8E5m2}) {
      auto v = RowView::Create(src, 64, 128, RowView::Output::kCodec, to);  // heads 1, 2
      ASSERT_TRUE(v.ok()) << v.status().message();
      std::vector<uint8_t> out(n * v->out_row_bytes());
      std::vector<float> scratch;
      v->Apply(stored.data(), n, out.data(), &scratch);
      // The target's own encoder over those columns of the decoded rows.
      const RowCodec dst = RowCodec::Create(to, 128).value();
      std::vector<float> cols(n * 128);
      for (size_t r = 0; r < n; ++r) {
        std::memcpy(&cols[r * 128], &decoded[r * dim + 64], 128 * sizeof(float));
      }
      std::vector<uint8_t> want(n * dst.row_bytes());
      dst.Encode(cols.data(), n, want.data());
      EXPECT_EQ(out, want) << FormatName(from) << " AS " << FormatName(to);
    }
    // The stored codec over all columns: the stored bytes themselves.
    auto same = RowView::Create(src, 0, dim, RowView::Output::kCodec, from);
    ASSERT_TRUE(same.ok());
    EXPECT_TRUE(same->identity());
  }
  // Lossless where the target holds the source exactly: fp16 rows AS fp32.
  const RowCodec h = RowCodec::Create(Format::kFp16, dim).value();
  std::vector<uint8_t> stored(n * h.row_bytes());
  h.Encode(x.data(), n, stored.data());
  std::vector<float> decoded(n * dim), out(n * dim), scratch;
  h.Decode(stored.data(), n, decoded.data());
  auto v = RowView::Create(h, 0, dim, RowView::Output::kCodec, Format::kFp32);
  v->Apply(stored.data(), n, reinterpret_cast<uint8_t*>(out.data()), &scratch);
  EXPECT_EQ(out, decoded);
}

TEST(RowView, RefusesWhatCannotBeSliced) {
  const RowCodec t = RowCodec::Create(Format::kTurbo4, 256).value();  // blocks of 128
  auto v = RowView::Create(t, 64, 128, RowView::Output::kStored);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("split its blocks of 128 values"), std::string::npos);
  EXPECT_TRUE(RowView::Create(t, 64, 128, RowView::Output::kFp32).ok());  // decoded: fine
  const RowCodec i8 = RowCodec::Create(Format::kInt8, 100).value();       // last block of 4
  EXPECT_TRUE(RowView::Create(i8, 64, 36, RowView::Output::kStored).ok());
  EXPECT_FALSE(RowView::Create(i8, 16, 32, RowView::Output::kStored).ok());
  EXPECT_FALSE(RowView::Create(i8, 90, 20, RowView::Output::kFp32).ok());  // past the row
  auto bad = RowView::Create(i8, 0, 100, RowView::Output::kCodec, Format::kTurbo4);
  ASSERT_FALSE(bad.ok());  // a turbo block of 128 does not divide 100
  EXPECT_NE(bad.status().message().find("AS turbo4 cannot hold rows of 100 values"),
            std::string::npos);
}

}  // namespace
}  // namespace pion::codec
