#include "store/vsession.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "residency/engine.h"

namespace pion::store {
namespace {

std::vector<float> RandomRows(size_t n, uint32_t dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n * dim);
  for (auto& x : v) x = d(rng);
  return v;
}

residency::Engine& DefaultEngine() {
  static residency::Engine e{residency::EngineOptions{}};
  return e;
}

VSession Make(codec::Format f, uint32_t dim, residency::Engine* engine = &DefaultEngine()) {
  return VSession(codec::RowCodec::Create(f, dim).value(), engine);
}

// Reads through a view (every chunk is in memory in these tests).
void DecodeRange(const VSession& s, int64_t a, int64_t b, float* out) {
  VSession::HostView view;
  std::vector<residency::ObjectRef> missing;
  ASSERT_TRUE(s.ViewRange(a, b, &view, &missing));
  s.DecodeRange(view, a, b, out);
}
void DecodeIds(const VSession& s, const int64_t* ids, size_t n, float* out) {
  VSession::HostView view;
  std::vector<residency::ObjectRef> missing;
  ASSERT_TRUE(s.ViewIds(ids, n, &view, &missing));
  s.DecodeIds(view, ids, n, out);
}

// Stores as V.STOREBATCH does: every chunk the store writes pinned in host memory first (all
// are resident in these tests).
Status StoreRange(VSession& s, int64_t start, const float* rows, size_t n) {
  std::vector<residency::ObjectRef> touched;
  if (start >= 0) s.ChunksForRange(start, n, &touched);
  residency::PinSet pins;
  for (const auto& o : touched) EXPECT_TRUE(pins.TryPin(o, residency::Tier::kHost));
  return s.StoreRange(start, rows, n, pins);
}
Status StoreIds(VSession& s, const int64_t* ids, const float* rows, size_t n) {
  std::vector<residency::ObjectRef> touched;
  s.ChunksForIds(ids, n, &touched);
  residency::PinSet pins;
  for (const auto& o : touched) EXPECT_TRUE(pins.TryPin(o, residency::Tier::kHost));
  return s.StoreIds(ids, rows, n, pins);
}

TEST(VSession, Fp32RangeRoundTripIsExact) {
  auto s = Make(codec::Format::kFp32, 96);
  auto rows = RandomRows(200, 96, 1);
  ASSERT_TRUE(StoreRange(s, 10, rows.data(), 200).ok());
  EXPECT_EQ(s.rows(), 200u);
  ASSERT_TRUE(s.CheckRange(10, 210).ok());
  std::vector<float> out(200 * 96);
  DecodeRange(s, 10, 210, out.data());
  EXPECT_EQ(out, rows);
  // Partial ranges across chunk boundaries.
  std::vector<float> part(70 * 96);
  DecodeRange(s, 60, 130, part.data());
  EXPECT_TRUE(std::equal(part.begin(), part.end(), rows.begin() + 50 * 96));
}

TEST(VSession, MissingIdsAreNamed) {
  auto s = Make(codec::Format::kFp16, 32);
  auto rows = RandomRows(5, 32, 2);
  ASSERT_TRUE(StoreRange(s, 0, rows.data(), 5).ok());
  EXPECT_EQ(s.CheckRange(0, 6).message(), "id 5 was never stored");
  EXPECT_EQ(s.CheckRange(100, 101).message(), "id 100 was never stored");
  int64_t ids[] = {1, 3, 9};
  EXPECT_EQ(s.CheckIds(ids, 3).message(), "id 9 was never stored");
  EXPECT_EQ(s.CountWritten(0, 64), 5u);
  EXPECT_FALSE(StoreRange(s, -1, rows.data(), 1).ok());
}

// CheckRange answers a range holding exactly the written ids without visiting its chunks; ranges
// with as many ids as are written, but not the same ones, still name the first missing id.
TEST(VSession, CompleteRangeCheckMatchesTheScan) {
  auto s = Make(codec::Format::kBf16, 16);
  auto rows = RandomRows(300, 16, 3);
  ASSERT_TRUE(StoreRange(s, 0, rows.data(), 100).ok());
  ASSERT_TRUE(StoreRange(s, 101, rows.data(), 100).ok());  // ids 0..99, 101..200: 200 rows
  EXPECT_EQ(s.CheckRange(0, 200).message(), "id 100 was never stored");
  EXPECT_EQ(s.CheckRange(1, 201).message(), "id 100 was never stored");
  ASSERT_TRUE(StoreRange(s, 100, rows.data(), 1).ok());
  EXPECT_TRUE(s.CheckRange(0, 201).ok());
  EXPECT_TRUE(s.CheckRange(64, 130).ok());
  EXPECT_EQ(s.CheckRange(0, 202).message(), "id 201 was never stored");
  EXPECT_EQ(s.CheckRange(5, 206).message(), "id 201 was never stored");
}

TEST(VSession, ScatteredIdsLastWriteWins) {
  auto s = Make(codec::Format::kFp32, 32);
  auto rows = RandomRows(3, 32, 3);
  int64_t ids[] = {1000, 7, 1000};
  ASSERT_TRUE(StoreIds(s, ids, rows.data(), 3).ok());
  EXPECT_EQ(s.rows(), 2u);
  std::vector<float> out(2 * 32);
  int64_t want[] = {7, 1000};
  ASSERT_TRUE(s.CheckIds(want, 2).ok());
  DecodeIds(s, want, 2, out.data());
  EXPECT_TRUE(std::equal(out.begin(), out.begin() + 32, rows.begin() + 32));
  EXPECT_TRUE(std::equal(out.begin() + 32, out.end(), rows.begin() + 64));
}

TEST(VSession, SnapshotIsPointInTime) {
  auto s = Make(codec::Format::kFp32, 32);
  auto a = RandomRows(100, 32, 4), b = RandomRows(100, 32, 5);
  ASSERT_TRUE(StoreRange(s, 0, a.data(), 100).ok());
  auto snap = s.TakeSnapshot();
  ASSERT_TRUE(StoreRange(s, 0, b.data(), 100).ok());
  ASSERT_TRUE(StoreRange(s, 100, b.data(), 10).ok());
  std::vector<float> out(100 * 32);
  DecodeRange(s, 0, 100, out.data());
  EXPECT_EQ(out, b);
  s.Restore(snap);
  DecodeRange(s, 0, 100, out.data());
  EXPECT_EQ(out, a);
  EXPECT_EQ(s.rows(), 100u);
  EXPECT_FALSE(s.CheckRange(100, 101).ok());
}

TEST(VSession, RawPiecesReferenceChunkBytesAndSurviveLaterWrites) {
  auto s = Make(codec::Format::kFp16, 64);
  auto rows = RandomRows(130, 64, 6);
  ASSERT_TRUE(StoreRange(s, 0, rows.data(), 130).ok());
  std::vector<std::pair<BufferRef, std::string>> pieces;
  VSession::HostView view;
  std::vector<residency::ObjectRef> missing;
  ASSERT_TRUE(s.ViewRange(10, 130, &view, &missing));
  s.RawRange(view, 10, 130, [&](const BufferRef& b, const uint8_t* p, size_t n) {
    pieces.emplace_back(b, std::string(reinterpret_cast<const char*>(p), n));
  });
  ASSERT_EQ(pieces.size(), 3u);  // ids 10..63, 64..127, 128..129: chunks 0, 1, 2
  ASSERT_TRUE(StoreRange(s, 0, RandomRows(130, 64, 7).data(), 130).ok());
  // The referenced bytes did not change under the holder: the write copied the chunk.
  std::string first(reinterpret_cast<const char*>(pieces[0].first->data()) + 10 * 128,
                    pieces[0].second.size());
  EXPECT_EQ(first, pieces[0].second);
}

TEST(VSession, HostBudgetChargesEveryLiveChunkAndRefusesAtomically) {
  uint64_t used = 0, limit = 0;
  residency::EngineOptions o;
  o.host[static_cast<int>(residency::Family::kVStore)] = {[&](uint64_t n) {
                                                            if (used + n > limit)
                                                              return Status(ErrorKind::kOom,
                                                                            "full");
                                                            used += n;
                                                            return Status::Ok();
                                                          },
                                                          [&](uint64_t n) { used -= n; }};
  residency::Engine engine(std::move(o));
  const uint64_t chunk = 64 * 32 * 4;
  limit = 2 * chunk;
  {
    auto s = Make(codec::Format::kFp32, 32, &engine);
    auto rows = RandomRows(200, 32, 8);
    EXPECT_EQ(s.BytesToStoreRange(0, 200), 4 * chunk);
    EXPECT_EQ(StoreRange(s, 0, rows.data(), 200).kind(), ErrorKind::kOom);  // needs 4 chunks
    EXPECT_EQ(s.rows(), 0u);
    EXPECT_EQ(used, 0u);  // the chunks it could reserve were given back
    EXPECT_EQ(s.chunk_count(), 0u);
    ASSERT_TRUE(StoreRange(s, 0, rows.data(), 128).ok());
    EXPECT_EQ(used, 2 * chunk);
    ASSERT_TRUE(StoreRange(s, 0, rows.data(), 1).ok());  // in place: no new bytes
    EXPECT_EQ(used, 2 * chunk);
    auto snap = s.TakeSnapshot();
    EXPECT_EQ(StoreRange(s, 0, rows.data(), 1).kind(), ErrorKind::kOom);  // COW needs a chunk
    limit = 3 * chunk;
    ASSERT_TRUE(StoreRange(s, 0, rows.data(), 1).ok());
    EXPECT_EQ(used, 3 * chunk);  // the snapshot's chunk and the session's copy
  }
  EXPECT_EQ(used, 0u);
}

// Issue 51: a write holds the chunks it writes pinned (so that making room for its new bytes
// cannot drop them); its own pins do not stop it writing in place, another request's do (that
// reader may be reading the bytes on another thread), and a chunk it did not pin is refused,
// not written blind.
TEST(VSession, WritesInPlaceUnderTheirOwnPinsAndCopyUnderAnothers) {
  auto s = Make(codec::Format::kFp32, 32);
  auto a = RandomRows(64, 32, 10), b = RandomRows(64, 32, 11), c = RandomRows(64, 32, 12);
  ASSERT_TRUE(StoreRange(s, 0, a.data(), 64).ok());
  const residency::Object* first = s.chunks().at(0)->obj.get();
  ASSERT_TRUE(StoreRange(s, 0, b.data(), 64).ok());
  EXPECT_EQ(s.chunks().at(0)->obj.get(), first);  // in place, under the write's own pin
  residency::PinSet reader;
  ASSERT_TRUE(reader.TryPin(s.chunks().at(0)->obj, residency::Tier::kHost));
  ASSERT_TRUE(StoreRange(s, 0, c.data(), 64).ok());
  EXPECT_NE(s.chunks().at(0)->obj.get(), first);  // copied: another request pins the old one
  std::vector<float> out(64 * 32);
  DecodeRange(s, 0, 64, out.data());
  EXPECT_EQ(out, c);
  residency::PinSet none;
  Status unpinned = s.StoreRange(0, a.data(), 1, none);
  EXPECT_EQ(unpinned.kind(), ErrorKind::kErr);
  EXPECT_NE(unpinned.message().find("chunk 0 of the session is written without being pinned"),
            std::string::npos)
      << unpinned.message();
  DecodeRange(s, 0, 64, out.data());
  EXPECT_EQ(out, c);  // unchanged
}

TEST(VSession, LossyCodecsStoreEncodedBytes) {
  for (auto f : {codec::Format::kInt8, codec::Format::kTurbo4, codec::Format::kTurbo2}) {
    auto s = Make(f, 128);
    auto rows = RandomRows(64, 128, 9);
    ASSERT_TRUE(StoreRange(s, 0, rows.data(), 64).ok());
    std::vector<float> out(64 * 128), ref(64 * 128);
    DecodeRange(s, 0, 64, out.data());
    std::vector<uint8_t> enc(64 * s.codec().row_bytes());
    s.codec().Encode(rows.data(), 64, enc.data());
    s.codec().Decode(enc.data(), 64, ref.data());
    EXPECT_EQ(out, ref);
    EXPECT_NE(out, rows);
  }
}

}  // namespace
}  // namespace pion::store
