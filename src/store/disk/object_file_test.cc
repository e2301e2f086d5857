#include "store/disk/object_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

namespace pion::store::disk {
namespace {

namespace fs = std::filesystem;

class ObjectFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("pion_obj_" + std::to_string(getpid()) + "_" + std::to_string(counter_++));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
    std::vector<uint8_t> v(n);
    std::mt19937 rng(seed);
    for (auto& b : v) b = static_cast<uint8_t>(rng());
    return v;
  }
  std::string Write(std::string_view name, uint64_t version,
                    const std::vector<std::vector<uint8_t>>& blocks,
                    std::string_view meta = "manifest") {
    std::vector<std::span<const uint8_t>> spans(blocks.begin(), blocks.end());
    Status s = WriteObject(dir_, name, version, meta, spans);
    EXPECT_TRUE(s.ok()) << s.message();
    auto listed = ListObjects(dir_);
    for (const auto& o : listed.value()) {
      if (o.name == name) return o.path;
    }
    return "";
  }
  static void FlipByte(const std::string& path, uint64_t offset) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(offset));
    char c;
    f.read(&c, 1);
    c ^= 0x40;
    f.seekp(static_cast<std::streamoff>(offset));
    f.write(&c, 1);
  }

  std::string dir_;
  static inline int counter_ = 0;
};

TEST_F(ObjectFileTest, RoundTripWithBlocksAndMeta) {
  std::vector<std::vector<uint8_t>> blocks = {Bytes(1000, 1), Bytes(0, 2), Bytes(70000, 3)};
  std::string path = Write("tenant\x01/ns:weird name", 7, blocks, std::string("meta\0data", 9));
  auto f = ObjectFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_EQ(f->version(), 7u);
  EXPECT_EQ(f->meta(), std::string("meta\0data", 9));
  ASSERT_EQ(f->block_count(), 3u);
  EXPECT_EQ(f->data_bytes(), 71000u);
  for (size_t i = 0; i < 3; ++i) {
    std::vector<uint8_t> out(f->block_length(i));
    ASSERT_TRUE(f->ReadBlock(i, out.data()).ok());
    EXPECT_EQ(out, blocks[i]);
  }
  auto listed = ListObjects(dir_);
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name, "tenant\x01/ns:weird name");  // any bytes survive the file name
}

TEST_F(ObjectFileTest, NewVersionReplacesOldOnlyAfterItIsDurable) {
  Write("obj", 1, {Bytes(100, 1)});
  std::string v2 = Write("obj", 2, {Bytes(100, 2)});
  auto listed = ListObjects(dir_);
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].version, 2u);
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) files += e.is_regular_file();
  EXPECT_EQ(files, 1u);  // version 1 was removed after version 2 became durable
  EXPECT_EQ(ObjectFile::Open(v2)->version(), 2u);
}

TEST_F(ObjectFileTest, InterruptedWriteLeavesThePreviousVersionServed) {
  std::string v1 = Write("obj", 1, {Bytes(100, 1)});
  // A crash between creating the temp file and the rename: a torn *.tmp next to version 1.
  std::ofstream(dir_ + "/" + fs::path(v1).stem().stem().string() + ".2.tmp") << "PIONOBJ1 torn";
  auto listed = ListObjects(dir_);
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].version, 1u);
  ASSERT_TRUE(RemoveLeftoverTemps(dir_).ok());
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) files += e.is_regular_file();
  EXPECT_EQ(files, 1u);
}

TEST_F(ObjectFileTest, CorruptedBlockIsDetectedOnRead) {
  std::string path = Write("obj", 1, {Bytes(4096, 1), Bytes(4096, 2)});
  auto size = fs::file_size(path);
  FlipByte(path, size - 8 - 10);  // inside the last block
  auto f = ObjectFile::Open(path);
  ASSERT_TRUE(f.ok());  // the header is intact
  std::vector<uint8_t> out(4096);
  EXPECT_TRUE(f->ReadBlock(0, out.data()).ok());
  Status s = f->ReadBlock(1, out.data());
  EXPECT_EQ(s.kind(), ErrorKind::kCorrupt);
  EXPECT_NE(s.message().find("block 1 checksum mismatch"), std::string::npos);
}

TEST_F(ObjectFileTest, CorruptedOrTruncatedHeaderIsRefusedOnOpen) {
  std::string path = Write("obj", 1, {Bytes(4096, 1)});
  FlipByte(path, 30);  // inside the meta bytes
  auto f = ObjectFile::Open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().kind(), ErrorKind::kCorrupt);
  EXPECT_NE(f.status().message().find("header checksum mismatch"), std::string::npos);

  std::string p2 = Write("obj2", 1, {Bytes(4096, 1)});
  fs::resize_file(p2, fs::file_size(p2) - 100);
  auto t = ObjectFile::Open(p2);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().kind(), ErrorKind::kCorrupt);

  std::ofstream(dir_ + "/junk.txt") << "not an object";
  std::ofstream(dir_ + "/zz.1.pobj") << "not hex";  // odd hex: not an object name
  auto listed = ListObjects(dir_);
  EXPECT_EQ(listed->size(), 2u);
  EXPECT_EQ(ObjectFile::Open(dir_ + "/junk.txt").status().kind(), ErrorKind::kCorrupt);
}

TEST_F(ObjectFileTest, RemoveObjectDeletesEveryVersion) {
  Write("a", 1, {Bytes(10, 1)});
  Write("b", 1, {Bytes(10, 1)});
  ASSERT_TRUE(RemoveObject(dir_, "a").ok());
  auto listed = ListObjects(dir_);
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name, "b");
  EXPECT_TRUE(RemoveObject(dir_ + "/missing", "a").ok());
}

}  // namespace
}  // namespace pion::store::disk
