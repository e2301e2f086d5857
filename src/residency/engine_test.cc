// The residency engine against real files in a temporary directory, real threads for its I/O
// and a fault injector: demotion under host pressure and promotion back byte-exact, coalesced
// promotions, deadlines, credits, in-place writes, and failed, short, corrupt and slow disks.
#include "residency/engine.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <random>
#include <thread>

#include "common/faults.h"

namespace pion::residency {
namespace {

namespace fs = std::filesystem;

// A tiny blocking worker pool, as the server's I/O pool.
class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Run(); });
  }
  ~Pool() {
    {
      std::lock_guard l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  bool Submit(std::function<void()> f) {
    std::lock_guard l(mu_);
    if (jobs_.size() >= capacity) return false;
    jobs_.push_back(std::move(f));
    cv_.notify_one();
    return true;
  }
  size_t capacity = 1024;

 private:
  void Run() {
    std::unique_lock l(mu_);
    while (true) {
      cv_.wait(l, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      auto f = std::move(jobs_.front());
      jobs_.pop_front();
      l.unlock();
      f();
      l.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Host memory with a limit, reclaiming clean replicas through the engine on a refusal (what
// the server's MemoryAccountant does).
struct HostMemory {
  std::atomic<uint64_t> used{0};
  uint64_t limit = 0;
  Engine* engine = nullptr;
  bool TryAdd(uint64_t n) {
    uint64_t cur = used.load();
    do {
      if (limit != 0 && cur + n > limit) return false;
    } while (!used.compare_exchange_weak(cur, cur + n));
    return true;
  }
  Status Reserve(uint64_t n) {
    if (TryAdd(n)) return Status::Ok();
    const uint64_t u = used.load();
    engine->ReclaimClean(Tier::kHost, std::nullopt, u + n > limit ? u + n - limit : n);
    if (TryAdd(n)) return Status::Ok();
    return Status(ErrorKind::kOom, "host full");
  }
  uint64_t Headroom() const {
    if (limit == 0) return UINT64_MAX;
    const uint64_t u = used.load();
    return u >= limit ? 0 : limit - u;
  }
};

// Faults by point: the next `count` calls get `fault`.
class TestInjector : public faults::Injector {
 public:
  faults::Fault Next(faults::Point p, std::string_view) override {
    std::lock_guard l(mu_);
    auto it = rules_.find(p);
    if (it == rules_.end() || it->second.second == 0) return {};
    --it->second.second;
    return it->second.first;
  }
  void Set(faults::Point p, faults::Action a, int count, int delay_ms = 0) {
    std::lock_guard l(mu_);
    rules_[p] = {faults::Fault{a, delay_ms}, count};
  }
  void Clear() {
    std::lock_guard l(mu_);
    rules_.clear();
  }

 private:
  std::mutex mu_;
  std::map<faults::Point, std::pair<faults::Fault, int>> rules_;
};

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("pion_res_" + std::to_string(getpid()) + "_" + std::to_string(counter_++));
    fs::remove_all(dir_);
    faults::Install(&injector_);
  }
  void TearDown() override {
    faults::Install(nullptr);
    engine_.reset();
    io_.reset();
    fs::remove_all(dir_);
  }

  void Make(uint64_t host_limit, uint64_t credits = 2ull << 30, uint64_t disk_quota = 0) {
    mem_.limit = host_limit;
    io_ = std::make_unique<Pool>(2);
    EngineOptions o;
    o.spill_dir = (dir_ / "spill").string();
    o.promotion_credits = credits;
    o.disk_quota = disk_quota;
    for (auto& b : o.host) {
      b.reserve = [this](uint64_t n) { return mem_.Reserve(n); };
      b.release = [this](uint64_t n) { mem_.used.fetch_sub(n); };
    }
    o.host_headroom = [this](Family) { return mem_.Headroom(); };
    o.host_headroom_any = [this] { return mem_.Headroom(); };
    o.run_io = [this](std::function<void()> f) { return io_->Submit(std::move(f)); };
    engine_ = std::make_unique<Engine>(std::move(o));
    mem_.engine = engine_.get();
    ASSERT_TRUE(engine_->Start().ok());
  }

  static std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
    std::vector<uint8_t> v(n);
    std::mt19937 rng(seed);
    for (auto& b : v) b = static_cast<uint8_t>(rng());
    return v;
  }

  // A host-resident object of one block with seed-determined bytes (its charge reserved,
  // making room first when needed).
  ObjectRef Put(size_t n, uint32_t seed, Family f = Family::kSsm) {
    return PutBlocks({n}, seed, f);
  }
  // The same with blocks of these sizes, each block the bytes Bytes(size, seed) gives.
  ObjectRef PutBlocks(std::vector<size_t> sizes, uint32_t seed, Family f = Family::kSsm) {
    size_t n = 0;
    for (size_t b : sizes) n += b;
    if (!engine_->RoomNow(Tier::kHost, f, n)) {
      std::promise<Status> p;
      engine_->MakeRoom(Tier::kHost, f, n, kNoDeadline, [&](const Status& s) { p.set_value(s); });
      Status s = p.get_future().get();
      EXPECT_TRUE(s.ok()) << s.message();
    }
    auto charge = engine_->ReserveHost(f, n);
    EXPECT_TRUE(charge.ok()) << charge.status().message();
    std::vector<BufferRef> blocks;
    for (size_t b : sizes) {
      auto buf = BufferAllocator::Default()->Allocate(b);
      auto bytes = Bytes(b, seed);
      if (b > 0) std::memcpy(buf.value()->data(), bytes.data(), b);
      blocks.push_back(buf.value());
    }
    return engine_->CreateInHost(f, std::move(blocks), std::move(charge).value());
  }

  Status RequireSync(std::vector<ObjectRef> objs, Tier tier, Deadline dl = kNoDeadline,
                     PinSet* keep = nullptr) {
    std::promise<Status> p;
    engine_->Require(std::move(objs), tier, dl, [&](const Status& s, PinSet pins) {
      if (keep != nullptr) *keep = std::move(pins);
      pins.Reset();  // released before the caller wakes (it may write in place next)
      p.set_value(s);
    });
    return p.get_future().get();
  }

  static bool Same(const ObjectRef& o, uint32_t seed) {
    BufferRef b = o->HostBlock(0);
    if (!b) return false;
    auto want = Bytes(o->block_size(0), seed);
    return std::memcmp(b->data(), want.data(), want.size()) == 0;
  }

  fs::path dir_;
  static inline int counter_ = 0;
  TestInjector injector_;
  HostMemory mem_;
  std::unique_ptr<Pool> io_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(EngineTest, PressureDemotesToDiskAndPromotionBringsBytesBackExact) {
  constexpr size_t kObj = 256 << 10;
  Make(/*host_limit=*/8 * kObj);
  std::vector<ObjectRef> objs;
  for (uint32_t i = 0; i < 32; ++i) objs.push_back(Put(kObj, i));  // 4x the host budget
  EXPECT_LE(mem_.used.load(), 8 * kObj);
  size_t on_disk = 0;
  for (auto& o : objs) on_disk += !o->Resident(Tier::kHost) && o->Resident(Tier::kDisk);
  EXPECT_GE(on_disk, 24u);
  auto st = engine_->stats();
  EXPECT_GE(st.demotions[1][2], 24u);
  // The oldest were demoted first (LRU): object 0 is on disk, the newest is in memory.
  EXPECT_FALSE(objs[0]->Resident(Tier::kHost));
  EXPECT_TRUE(objs[31]->Resident(Tier::kHost));
  for (uint32_t i = 0; i < objs.size(); ++i) {
    PinSet pins;
    ASSERT_TRUE(RequireSync({objs[i]}, Tier::kHost, kNoDeadline, &pins).ok()) << i;
    EXPECT_TRUE(Same(objs[i], i)) << i;
    EXPECT_LE(mem_.used.load(), 8 * kObj);
  }
  st = engine_->stats();
  EXPECT_GE(st.promotions[2][1], 24u);
  EXPECT_GE(st.backend_reads, 24u);
}

TEST_F(EngineTest, ConcurrentReadersOfOneColdObjectShareOneReadPerBlock) {
  Make(0);
  // Three blocks, one object, written to a saved file and known only from it.
  std::vector<std::vector<uint8_t>> blocks = {Bytes(100000, 1), Bytes(5000, 2), Bytes(70000, 3)};
  std::vector<std::span<const uint8_t>> spans(blocks.begin(), blocks.end());
  auto file = engine_->WriteSaved((dir_ / "saved").string(), "obj", 1, "meta", spans);
  ASSERT_TRUE(file.ok()) << file.status().message();
  ObjectRef o =
      engine_->CreateOnDisk(Family::kAttention, {100000, 5000, 70000}, file.value(), {0, 1, 2});
  injector_.Set(faults::Point::kDiskRead, faults::Action::kSlow, 3, 50);  // all join in time
  constexpr int kReaders = 50;
  std::vector<std::future<Status>> got;
  std::vector<std::promise<Status>> ps(kReaders);
  for (int i = 0; i < kReaders; ++i) {
    got.push_back(ps[i].get_future());
    engine_->Require({o}, Tier::kHost, kNoDeadline,
                     [&, i](const Status& s, PinSet) { ps[i].set_value(s); });
  }
  for (auto& g : got) EXPECT_TRUE(g.get().ok());
  auto st = engine_->stats();
  EXPECT_EQ(st.backend_reads, 3u);  // one read per block, not per reader
  EXPECT_EQ(st.coalesced, kReaders - 1u);
  std::vector<BufferRef> host;
  ASSERT_TRUE(o->HostBlocks(&host));
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(0, std::memcmp(host[i]->data(), blocks[i].data(), blocks[i].size()));
  }
}

TEST_F(EngineTest, DeadlineThatAPromotionCannotMeetIsRefusedInTime) {
  Make(0);
  auto data = Bytes(1 << 20, 9);
  std::vector<std::span<const uint8_t>> spans{{data.data(), data.size()}};
  auto file = engine_->WriteSaved((dir_ / "saved").string(), "slow", 1, "", spans);
  ASSERT_TRUE(file.ok());
  ObjectRef o = engine_->CreateOnDisk(Family::kSsm, {data.size()}, file.value(), {0});
  injector_.Set(faults::Point::kDiskRead, faults::Action::kSlow, 1, 300);
  const auto t0 = Clock::now();
  Status s = RequireSync({o}, Tier::kHost, t0 + std::chrono::milliseconds(40));
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_EQ(s.kind(), ErrorKind::kTimeout) << s.message();
  EXPECT_LE(ms, 40 + 25);  // answered at the deadline, not after the 300 ms read
  EXPECT_NE(s.message().find("disk_read"), std::string::npos) << s.message();
  // The transfer went on: a later reader finds it resident (or joins it) and gets the bytes.
  ASSERT_TRUE(RequireSync({o}, Tier::kHost).ok());
  EXPECT_EQ(0, std::memcmp(o->HostBlock(0)->data(), data.data(), data.size()));
  EXPECT_GE(engine_->stats()
                .refusals[static_cast<int>(Stage::kDiskRead)][static_cast<int>(Refusal::kDeadline)],
            1u);
}

TEST_F(EngineTest, DeadlineBelowTheMeasuredRateIsRefusedBeforeAnyRead) {
  Make(0);
  auto data = Bytes(8 << 20, 4);
  std::vector<std::span<const uint8_t>> spans{{data.data(), data.size()}};
  auto file = engine_->WriteSaved((dir_ / "saved").string(), "big", 1, "", spans);
  ASSERT_TRUE(file.ok());
  ObjectRef o = engine_->CreateOnDisk(Family::kSsm, {data.size()}, file.value(), {0});
  // 8 MiB cannot be read in 1 µs at any plausible rate: refused at once, nothing read.
  Status s = RequireSync({o}, Tier::kHost, Clock::now() + std::chrono::microseconds(1));
  EXPECT_EQ(s.kind(), ErrorKind::kTimeout);
  EXPECT_NE(s.message().find("cannot be met"), std::string::npos) << s.message();
  EXPECT_EQ(engine_->stats().backend_reads, 0u);
}

TEST_F(EngineTest, PromotionCreditsRefuseWithBusy) {
  Make(0, /*credits=*/1 << 20);
  std::vector<ObjectRef> objs;
  for (int i = 0; i < 2; ++i) {
    auto data = Bytes(768 << 10, i);
    std::vector<std::span<const uint8_t>> spans{{data.data(), data.size()}};
    auto file =
        engine_->WriteSaved((dir_ / "saved").string(), "o" + std::to_string(i), 1, "", spans);
    objs.push_back(engine_->CreateOnDisk(Family::kSsm, {data.size()}, file.value(), {0}));
  }
  injector_.Set(faults::Point::kDiskRead, faults::Action::kSlow, 1, 200);
  std::promise<Status> first;
  engine_->Require({objs[0]}, Tier::kHost, kNoDeadline,
                   [&](const Status& s, PinSet) { first.set_value(s); });
  Status second = RequireSync({objs[1]}, Tier::kHost);
  EXPECT_EQ(second.kind(), ErrorKind::kBusy) << second.message();
  EXPECT_NE(second.message().find("promotion queue full"), std::string::npos);
  EXPECT_TRUE(first.get_future().get().ok());
  EXPECT_TRUE(RequireSync({objs[1]}, Tier::kHost).ok());  // credits came back
}

TEST_F(EngineTest, InPlaceWritesOnlyWhenExclusiveAndTheyDropStaleCopies) {
  constexpr size_t kObj = 64 << 10;
  Make(4 * kObj);
  ObjectRef a = Put(kObj, 1);
  {
    BufferRef held = a->HostBlock(0);  // a reply in flight
    EXPECT_EQ(a->BeginWrite(0), nullptr);
  }
  {
    PinSet reader;  // a request reading it (perhaps on another thread)
    ASSERT_TRUE(reader.TryPin(a, Tier::kHost));
    EXPECT_EQ(a->BeginWrite(0), nullptr);
  }
  PinSet writer;  // the writer's own pin keeps it in memory and does not stop the write
  ASSERT_TRUE(writer.TryPin(a, Tier::kHost));
  EXPECT_EQ(writer.Counts(Tier::kHost).at(a.get()), 1u);
  uint8_t* p = a->BeginWrite(0, /*own_host_pins=*/1);
  ASSERT_NE(p, nullptr);
  p[0] ^= 1;
  a->EndWrite();
  writer.Reset();
  EXPECT_EQ(a->generation(), 2u);
  // Demote it by pressure, promote it back, then a write drops the now stale disk copy.
  std::vector<ObjectRef> others;
  for (int i = 0; i < 8; ++i) others.push_back(Put(kObj, 10 + i));
  EXPECT_FALSE(a->Resident(Tier::kHost));
  ASSERT_TRUE(RequireSync({a}, Tier::kHost).ok());
  EXPECT_TRUE(a->Resident(Tier::kDisk));
  p = a->BeginWrite(0);
  ASSERT_NE(p, nullptr);
  a->EndWrite();
  EXPECT_FALSE(a->Resident(Tier::kDisk));
}

// An object with an empty block (an SSM prefix's empty state; the command fuzzer found it)
// spills and comes back like any other: the spill write's read-back check compares no bytes.
TEST_F(EngineTest, EmptyBlocksSpillAndComeBack) {
  constexpr size_t kObj = 64 << 10;
  Make(/*host_limit=*/4 * kObj);
  std::vector<ObjectRef> objs;
  for (uint32_t i = 0; i < 16; ++i) objs.push_back(PutBlocks({0, kObj}, i));  // 4x the host budget
  size_t on_disk = 0;
  for (auto& o : objs) on_disk += !o->Resident(Tier::kHost) && o->Resident(Tier::kDisk);
  EXPECT_GE(on_disk, 8u);
  const auto st = engine_->stats();
  uint64_t refused = 0;  // no spill write failed its read-back check
  for (uint64_t n : st.refusals[static_cast<int>(Stage::kDiskWrite)]) refused += n;
  EXPECT_EQ(refused, 0u);
  for (uint32_t i = 0; i < objs.size(); ++i) {
    PinSet pins;
    ASSERT_TRUE(RequireSync({objs[i]}, Tier::kHost, kNoDeadline, &pins).ok()) << i;
    EXPECT_EQ(objs[i]->block_size(0), 0u);
    BufferRef b = objs[i]->HostBlock(1);
    ASSERT_TRUE(b) << i;
    auto want = Bytes(kObj, i);
    EXPECT_EQ(std::memcmp(b->data(), want.data(), kObj), 0) << i;
  }
}

TEST_F(EngineTest, FailedOrShortSpillWritesLoseNothing) {
  constexpr size_t kObj = 128 << 10;
  Make(4 * kObj);
  std::vector<ObjectRef> objs;
  for (uint32_t i = 0; i < 4; ++i) objs.push_back(Put(kObj, i));
  for (auto action : {faults::Action::kError, faults::Action::kShort, faults::Action::kNoSpace}) {
    injector_.Set(faults::Point::kDiskWrite, action, 1000);
    std::promise<Status> p;
    engine_->MakeRoom(Tier::kHost, Family::kSsm, kObj, kNoDeadline,
                      [&](const Status& s) { p.set_value(s); });
    Status s = p.get_future().get();
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("nothing was lost"), std::string::npos) << s.message();
    // A full disk is no room (-OOM tier=host, as PROTOCOL.md says); a failing one is -IOERR.
    EXPECT_EQ(s.kind(), action == faults::Action::kNoSpace ? ErrorKind::kOom : ErrorKind::kIo)
        << s.message();
    for (uint32_t i = 0; i < objs.size(); ++i) EXPECT_TRUE(Same(objs[i], i)) << i;
  }
  injector_.Clear();
  EXPECT_TRUE(fs::is_empty(dir_ / "spill"));  // failed segments left nothing behind
  ObjectRef more = Put(kObj, 99);             // the disk works again: demotion proceeds
  EXPECT_TRUE(Same(more, 99));
}

TEST_F(EngineTest, CorruptSpillCopyIsNeverServedAndTransientCorruptionHeals) {
  constexpr size_t kObj = 128 << 10;
  Make(2 * kObj);
  ObjectRef a = Put(kObj, 1), b = Put(kObj, 2), c = Put(kObj, 3), d = Put(kObj, 4);
  ASSERT_FALSE(a->Resident(Tier::kHost));
  ASSERT_FALSE(b->Resident(Tier::kHost));
  // A flipped byte on its way in: read again, then good.
  injector_.Set(faults::Point::kDiskRead, faults::Action::kCorrupt, 1);
  ASSERT_TRUE(RequireSync({a}, Tier::kHost).ok());
  EXPECT_TRUE(Same(a, 1));
  // A corrupted file: b's only copy fails validation — refused, never served, the rest fine.
  std::string path;
  for (auto& e : fs::directory_iterator(dir_ / "spill")) path = e.path().string();
  ASSERT_FALSE(path.empty());
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-100, std::ios::end);  // inside the last block written
    f.put('\x42');
  }
  // Whichever spilled object lives in that block is lost; every other one comes back exact.
  int corrupt = 0, exact = 0;
  std::vector<std::pair<ObjectRef, uint32_t>> all = {{a, 1}, {b, 2}, {c, 3}, {d, 4}};
  for (auto& [o, seed] : all) {
    Status s = RequireSync({o}, Tier::kHost);
    if (s.kind() == ErrorKind::kCorrupt) {
      ++corrupt;
      EXPECT_FALSE(o->lost().empty());
      EXPECT_EQ(RequireSync({o}, Tier::kHost).kind(), ErrorKind::kCorrupt);  // never served
    } else {
      ASSERT_TRUE(s.ok()) << s.message();
      exact += Same(o, seed);
    }
  }
  EXPECT_EQ(corrupt + exact, 4);
  EXPECT_LE(corrupt, 1);
  EXPECT_GE(engine_->stats().corrupt_replicas, static_cast<uint64_t>(corrupt));
}

TEST_F(EngineTest, DurableCopyMakesDemotionFree) {
  constexpr size_t kObj = 128 << 10;
  Make(2 * kObj);
  ObjectRef a = Put(kObj, 1);
  BufferRef bytes = a->HostBlock(0);
  std::vector<std::span<const uint8_t>> spans{{bytes->data(), bytes->size()}};
  auto file = engine_->WriteSaved((dir_ / "saved").string(), "a", 1, "", spans);
  ASSERT_TRUE(file.ok());
  engine_->AttachDisk(a, a->generation(), file.value(), {0});
  bytes.reset();
  EXPECT_TRUE(a->Durable());
  ObjectRef b = Put(kObj, 2);
  ObjectRef c = Put(kObj, 3);  // needs a's room: a goes without a spill write
  EXPECT_FALSE(a->Resident(Tier::kHost));
  EXPECT_EQ(engine_->stats().spill_files, 0u);
  ASSERT_TRUE(RequireSync({a}, Tier::kHost).ok());
  EXPECT_TRUE(Same(a, 1));
}

TEST_F(EngineTest, DiskQuotaRefusesTypedAndKeepsMemoryCopies) {
  constexpr size_t kObj = 256 << 10;
  Make(2 * kObj, 2ull << 30, /*disk_quota=*/kObj / 2);
  ObjectRef a = Put(kObj, 1), b = Put(kObj, 2);
  std::promise<Status> p;
  engine_->MakeRoom(Tier::kHost, Family::kSsm, kObj, kNoDeadline,
                    [&](const Status& s) { p.set_value(s); });
  Status s = p.get_future().get();
  EXPECT_EQ(s.kind(), ErrorKind::kOom);
  EXPECT_NE(s.message().find("tier=disk"), std::string::npos) << s.message();
  EXPECT_TRUE(Same(a, 1));
  EXPECT_TRUE(Same(b, 2));
}

TEST_F(EngineTest, PinnedObjectsAreNotDemotedAndHostRoomIsTypedWhenAllArePinned) {
  constexpr size_t kObj = 128 << 10;
  Make(2 * kObj);
  ObjectRef a = Put(kObj, 1), b = Put(kObj, 2);
  PinSet pins;
  ASSERT_TRUE(pins.TryPin(a, Tier::kHost));
  ASSERT_TRUE(pins.TryPin(b, Tier::kHost));
  std::promise<Status> p;
  engine_->MakeRoom(Tier::kHost, Family::kSsm, kObj, kNoDeadline,
                    [&](const Status& s) { p.set_value(s); });
  Status s = p.get_future().get();
  EXPECT_EQ(s.kind(), ErrorKind::kOom);
  EXPECT_NE(s.message().find("tier=host"), std::string::npos) << s.message();
  pins.Reset();
  EXPECT_TRUE(Same(Put(kObj, 3), 3));
  EXPECT_TRUE(a->Resident(Tier::kDisk));
}

// Issue 51: after a restart every object is known by its saved file and its last use is when it
// was found. Read in the order clients happen to use them — many small chunks opened and read
// one after another, then larger objects found long before them — every host copy is clean,
// so each promotion makes its room by dropping others, however their last uses and their
// places in the tier list differ: never -OOM, never a spill write.
TEST_F(EngineTest, CleanCopiesPromotedFromSavedFilesAlwaysMakeRoom) {
  constexpr size_t kChunk = 8 << 10, kLarge = 128 << 10;
  Make(/*host_limit=*/256 * kChunk);
  auto saved = [&](size_t n, uint32_t seed, Family f) {
    auto data = Bytes(n, seed);
    std::vector<std::span<const uint8_t>> spans{{data.data(), data.size()}};
    auto file =
        engine_->WriteSaved((dir_ / "saved").string(), "o" + std::to_string(seed), 1, "", spans);
    EXPECT_TRUE(file.ok()) << file.status().message();
    return engine_->CreateOnDisk(f, {n}, file.value(), {0});
  };
  auto read = [&](const ObjectRef& o, uint32_t seed) {
    PinSet pins;
    Status s = RequireSync({o}, Tier::kHost, kNoDeadline, &pins);
    pins.Reset();
    EXPECT_TRUE(s.ok()) << "object " << seed << ": " << s.message();
    EXPECT_TRUE(s.ok() && Same(o, seed)) << seed;
  };
  std::vector<ObjectRef> large;
  for (uint32_t i = 0; i < 12; ++i) large.push_back(saved(kLarge, 1000 + i, Family::kAttention));
  std::vector<ObjectRef> chunks;
  for (uint32_t ns = 0; ns < 32; ++ns) {  // each namespace found when first read: 16 chunks
    for (uint32_t c = 0; c < 16; ++c) chunks.push_back(saved(kChunk, ns * 16 + c, Family::kVStore));
    for (uint32_t c = 0; c < 16; ++c) read(chunks[ns * 16 + c], ns * 16 + c);
  }
  for (uint32_t i = 0; i < large.size(); ++i) read(large[i], 1000 + i);
  EXPECT_LE(mem_.used.load(), 256 * kChunk);
  const auto st = engine_->stats();
  EXPECT_EQ(st.spill_files, 0u);  // dropped, nothing written
  EXPECT_EQ(st.refusals[static_cast<int>(Stage::kHostRoom)][static_cast<int>(Refusal::kOom)], 0u);
}

}  // namespace
}  // namespace pion::residency
