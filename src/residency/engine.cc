#include "residency/engine.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "common/bytes.h"
#include "common/faults.h"
#include "store/disk/object_file.h"

namespace pion::residency {

std::string Human(uint64_t bytes) { return HumanBytes(bytes); }

namespace {

constexpr int T(Tier t) { return static_cast<int>(t); }
constexpr int F(Family f) { return static_cast<int>(f); }

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string Ms(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f ms", seconds * 1e3);
  return buf;
}

std::string Rate(double bytes_per_s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.0f MB/s", bytes_per_s / 1e6);
  return buf;
}

// A demotion writes at most this much into one spill segment.
constexpr uint64_t kSpillSegmentBytes = 64ull << 20;

}  // namespace

// One in-flight promotion of one object into one tier, shared by every request waiting for it.
struct Transfer {
  ObjectRef obj;
  Tier to;
  uint64_t generation;
  int attempts = 0;  // rooms made for it that others took first
  std::vector<std::function<void(const Status&)>> waiters;  // under obj->mu_
};

// A Require in progress: completes once every missing object arrived (or one failed, or the
// deadline passed), exactly once.
struct Engine::Join {
  PinnedDone done;
  Tier tier;
  std::mutex mu;
  size_t left = 0;
  bool finished = false;
  PinSet pins;
  uint64_t timer = 0;
  TimerQueue* timers = nullptr;

  // One object arrived (pinned in `tier` by the transfer on our behalf) or failed.
  void Arrive(const Status& s, const ObjectRef& obj) {
    std::unique_lock lock(mu);
    if (finished) {
      lock.unlock();
      if (s.ok()) {  // answered already (timed out): give the pin back
        PinSet late;
        late.Adopt(obj, tier);
      }
      return;
    }
    if (s.ok()) pins.Adopt(obj, tier);
    if (!s.ok() || --left == 0) Finish(lock, s);
  }
  void Finish(std::unique_lock<std::mutex>& lock, const Status& s) {
    finished = true;
    PinSet out = std::move(pins);
    auto cb = std::move(done);
    const uint64_t t = timer;
    lock.unlock();
    if (t != 0) timers->Cancel(t);
    if (!s.ok()) out.Reset();
    cb(s, std::move(out));
  }
  void Expire(const Status& s) {
    std::unique_lock lock(mu);
    if (finished) return;
    timer = 0;
    Finish(lock, s);
  }
};

// A MakeRoom in progress.
struct Engine::RoomRequest {
  Tier tier;
  Family family;
  uint64_t bytes;
  Deadline deadline;
  Done done;
  std::atomic<bool> finished{false};
  uint64_t timer = 0;
  int rounds = 0;
  Clock::time_point started = Clock::now();
};

Engine::Engine(EngineOptions options)
    : opts_(std::move(options)),
      gpu_(opts_.gpu_limit),
      disk_(opts_.disk_quota),
      meters_{BandwidthMeter(2e9), BandwidthMeter(1e9), BandwidthMeter(20e9),
              BandwidthMeter(10e9)} {
  gpu_extra_.reserve = [this](uint64_t n) {
    return ReserveGpuExtra(n)
               ? Status::Ok()
               : Status(ErrorKind::kOom, "tier=gpu: " + std::to_string(n) +
                                             " bytes for block summaries do not fit in "
                                             "--gpu-memory " +
                                             std::to_string(gpu_.limit()));
  };
  gpu_extra_.release = [this](uint64_t n) { gpu_.Release(n); };
}

Engine::~Engine() = default;

Status Engine::Start() {
  if (opts_.spill_dir.empty()) return Status::Ok();
  std::error_code ec;
  std::filesystem::remove_all(opts_.spill_dir, ec);  // a dead process's spills: never served
  std::filesystem::create_directories(opts_.spill_dir, ec);
  if (ec) {
    return Status(ErrorKind::kIo,
                  "cannot create spill directory " + opts_.spill_dir + ": " + ec.message());
  }
  return Status::Ok();
}

// ---- Tier lists ---------------------------------------------------------------------------

void Engine::LinkLocked(Object* o, Tier t) {
  Object::Link& l = o->links_[T(t)];
  if (l.linked) return;
  List& list = lists_[T(t)];
  l.prev = nullptr;
  l.next = list.head;
  if (list.head != nullptr) list.head->links_[T(t)].prev = o;
  list.head = o;
  if (list.tail == nullptr) list.tail = o;
  l.linked = true;
  // The list stays ordered by stamp, newest at the head, which the demotion walk relies on: an
  // object linked at the head (a promotion of one found on disk long ago, a spill copy) ranks
  // as recently placed even when its last use is older than the head's.
  const int64_t used = o->last_use_.load(std::memory_order_relaxed);
  l.stamp = l.next != nullptr ? std::max(used, l.next->links_[T(t)].stamp) : used;
  ++list.count;
  list.bytes += o->bytes_;
}

void Engine::UnlinkLocked(Object* o, Tier t) {
  Object::Link& l = o->links_[T(t)];
  if (!l.linked) return;
  List& list = lists_[T(t)];
  if (l.prev != nullptr) {
    l.prev->links_[T(t)].next = l.next;
  } else {
    list.head = l.next;
  }
  if (l.next != nullptr) {
    l.next->links_[T(t)].prev = l.prev;
  } else {
    list.tail = l.prev;
  }
  l.prev = l.next = nullptr;
  l.linked = false;
  --list.count;
  list.bytes -= o->bytes_;
}

void Engine::ReorderLocked(Object* o, Tier t, int64_t used) {
  // The list is ordered by stamp, newest at the head; find the first entry not newer than
  // `used` from the head (recently used objects land near it, so the walk is short).
  UnlinkLocked(o, t);
  List& list = lists_[T(t)];
  Object* at = list.head;
  for (int steps = 0; at != nullptr && at->links_[T(t)].stamp > used && steps < 256; ++steps) {
    at = at->links_[T(t)].next;
  }
  Object::Link& l = o->links_[T(t)];
  // Where the walk stopped early, `at` may be newer than `used`: o takes its stamp, so that the
  // order holds.
  if (at != nullptr && at->links_[T(t)].stamp > used) used = at->links_[T(t)].stamp;
  if (at == nullptr) {  // older than everything: the tail
    l.prev = list.tail;
    l.next = nullptr;
    if (list.tail != nullptr) list.tail->links_[T(t)].next = o;
    list.tail = o;
    if (list.head == nullptr) list.head = o;
  } else {  // just before `at`
    l.next = at;
    l.prev = at->links_[T(t)].prev;
    if (l.prev != nullptr) {
      l.prev->links_[T(t)].next = o;
    } else {
      list.head = o;
    }
    at->links_[T(t)].prev = o;
  }
  l.linked = true;
  l.stamp = used;
  ++list.count;
  list.bytes += o->bytes_;
}

void Engine::Forget(Object* o) {
  std::lock_guard lock(dir_mu_);
  for (int t = 0; t < kTierCount; ++t) UnlinkLocked(o, static_cast<Tier>(t));
}

// ---- Objects ------------------------------------------------------------------------------

ObjectRef Engine::CreateInHost(Family f, std::vector<BufferRef> blocks,
                               std::unique_ptr<Charge> charge, BufferAllocator* alloc) {
  std::vector<uint64_t> sizes;
  for (const auto& b : blocks) sizes.push_back(b->size());
  ObjectRef o(new Object(this, f, NextId(), std::move(sizes), alloc));
  auto h = std::make_shared<HostReplica>();
  h->blocks = std::move(blocks);
  h->charge = std::move(charge);
  std::lock_guard dir(dir_mu_);
  std::lock_guard lock(o->mu_);
  o->host_ = std::move(h);
  LinkLocked(o.get(), Tier::kHost);
  return o;
}

ObjectRef Engine::CreateOnDisk(Family f, std::vector<uint64_t> sizes,
                               std::shared_ptr<DiskFile> file, std::vector<uint32_t> blocks,
                               BufferAllocator* alloc) {
  ObjectRef o(new Object(this, f, NextId(), std::move(sizes), alloc));
  auto d = std::make_shared<DiskCopy>();
  d->file = std::move(file);
  d->blocks = std::move(blocks);
  std::lock_guard dir(dir_mu_);
  std::lock_guard lock(o->mu_);
  o->disk_ = std::move(d);
  LinkLocked(o.get(), Tier::kDisk);
  return o;
}

StatusOr<std::unique_ptr<Charge>> Engine::ReserveHost(Family f, uint64_t bytes) {
  const ByteBudget& b = opts_.host[F(f)];
  if (b.reserve) {
    Status s = b.reserve(bytes);
    if (!s.ok()) return s;
  }
  return std::make_unique<Charge>(b.release ? &b : nullptr, bytes);
}

// ---- Room ---------------------------------------------------------------------------------

uint64_t Engine::Headroom(Tier tier, Family f) const {
  switch (tier) {
    case Tier::kGpu:
      return gpu_.free();
    case Tier::kHost:
      return opts_.host_headroom ? opts_.host_headroom(f) : UINT64_MAX;
    case Tier::kDisk: {
      const uint64_t l = disk_.limit(), u = disk_.used();
      return l == 0 ? UINT64_MAX : (u >= l ? 0 : l - u);
    }
  }
  return 0;
}

bool Engine::RoomNow(Tier tier, Family f, uint64_t bytes) {
  uint64_t head = Headroom(tier, f);
  if (head >= bytes) return true;
  // The family's own cap binds when the whole-server headroom would do: then only its own
  // objects can make room.
  std::optional<Family> only;
  if (tier == Tier::kHost && opts_.host_headroom_any && opts_.host_headroom_any() >= bytes) {
    only = f;
  }
  ReclaimClean(tier, only, bytes - head);
  return Headroom(tier, f) >= bytes;
}

uint64_t Engine::ReclaimClean(Tier tier, std::optional<Family> only, uint64_t need) {
  uint64_t freed = 0;
  PickVictims(tier, only, need, &freed, /*dirty=*/false);
  return freed;
}

std::vector<Engine::Victim> Engine::PickVictims(Tier tier, std::optional<Family> only,
                                                uint64_t need, uint64_t* freed, bool dirty_ok) {
  std::vector<Victim> victims;
  std::vector<ObjectRef> keep;  // released after the lock: a last ref runs ~Object (dir_mu_)
  std::vector<std::shared_ptr<HostReplica>> dead_host;
  std::vector<std::shared_ptr<GpuReplica>> dead_gpu;
  std::vector<std::shared_ptr<DiskCopy>> dead_disk;
  const bool want_dirty = dirty_ok;
  uint64_t dirty = 0;
  {
    std::lock_guard dir(dir_mu_);
    List& list = lists_[T(tier)];
    // Each object is looked at once, or twice when its last use moves it up the list first (a
    // bound, not a count: readers may use objects meanwhile).
    uint64_t steps = 2 * list.count + 1;
    Object* o = list.tail;
    while (o != nullptr && steps-- > 0 && *freed + dirty < need) {
      Object* prev = o->links_[T(tier)].prev;
      ObjectRef sp = o->weak_from_this().lock();
      if (!sp) {
        o = prev;
        continue;
      }
      keep.push_back(sp);
      std::lock_guard lock(o->mu_);
      if (only && o->family_ != *only) {
        o = prev;
        continue;
      }
      // Used since it took its place in the list: move it to where its last use puts it.
      const int64_t used = o->last_use_.load(std::memory_order_relaxed);
      if (used > o->links_[T(tier)].stamp) {
        ReorderLocked(o, tier, used);
        // Still in the same place (older than the next one up): look at it again. Otherwise it
        // moved up and the walk meets it there in its turn.
        if (o->links_[T(tier)].prev != prev) o = prev;
        continue;
      }
      const bool busy = o->pins_[T(tier)] > 0 || o->writing_ || o->moving_ ||
                        o->promoting_[T(Tier::kGpu)] || o->promoting_[T(Tier::kHost)];
      if (busy) {
        o = prev;
        continue;
      }
      if (tier == Tier::kHost) {
        if (!o->host_ || o->host_.use_count() > 1) {  // a reply still holds it: frees nothing
          o = prev;
          continue;
        }
        if (o->disk_ || o->gpu_) {  // clean: another tier holds the bytes
          dead_host.push_back(std::move(o->host_));
          UnlinkLocked(o, tier);
          *freed += o->bytes_;
          drops_[T(tier)].fetch_add(1, std::memory_order_relaxed);
        } else if (want_dirty) {
          o->moving_ = true;
          victims.push_back({sp, o->generation_, o->host_, nullptr});
          dirty += o->bytes_;
        }
      } else if (tier == Tier::kGpu) {
        if (!o->gpu_ || o->gpu_->readers() > 0) {
          o = prev;
          continue;
        }
        if (o->host_ || o->disk_) {
          dead_gpu.push_back(std::move(o->gpu_));
          UnlinkLocked(o, tier);
          *freed += o->bytes_;
          drops_[T(tier)].fetch_add(1, std::memory_order_relaxed);
        } else if (want_dirty) {
          o->moving_ = true;
          victims.push_back({sp, o->generation_, nullptr, o->gpu_});
          dirty += o->bytes_;
        }
      } else {  // disk: only spill copies another tier makes redundant
        if (o->disk_ && !o->disk_->durable() && (o->host_ || o->gpu_)) {
          dead_disk.push_back(std::move(o->disk_));
          UnlinkLocked(o, tier);
          *freed += o->bytes_;
          drops_[T(tier)].fetch_add(1, std::memory_order_relaxed);
        }
      }
      o = prev;
    }
    // Dirty victims are demotions in flight from now on (others waiting for room see them
    // before their jobs start), until RoomStep hands them to those jobs.
    if (!victims.empty() && need > *freed) ++demotions_in_flight_[T(tier)];
  }
  if (need <= *freed) {  // clean drops sufficed: nothing stays marked
    Unmark(victims);
    victims.clear();
  }
  return victims;
}

void Engine::EndPick(Tier tier) {
  {
    std::lock_guard dir(dir_mu_);
    --demotions_in_flight_[T(tier)];
  }
  WakeRoomWaiters(tier);
}

void Engine::Unmark(const std::vector<Victim>& victims) {
  for (const Victim& v : victims) {
    std::lock_guard lock(v.obj->mu_);
    v.obj->moving_ = false;
  }
}

void Engine::MakeRoom(Tier tier, Family f, uint64_t bytes, Deadline deadline, Done done) {
  auto r = std::make_shared<RoomRequest>();
  r->tier = tier;
  r->family = f;
  r->bytes = bytes;
  r->deadline = deadline;
  r->done = std::move(done);
  if (deadline != kNoDeadline) {
    std::weak_ptr<RoomRequest> w = r;
    r->timer = timers_.Add(deadline, [this, w] {
      if (auto rr = w.lock()) {
        Refuse(rr->tier == Tier::kGpu ? Stage::kGpuRoom : Stage::kHostRoom, Refusal::kDeadline);
        FinishRoom(rr, Status(ErrorKind::kTimeout,
                              "deadline passed while demotions made room for " + Human(rr->bytes) +
                                  " in " + std::string(TierName(rr->tier))));
      }
    });
  }
  RoomStep(r);
}

void Engine::FinishRoom(const std::shared_ptr<RoomRequest>& r, const Status& s) {
  if (r->finished.exchange(true)) return;
  if (r->timer != 0) timers_.Cancel(r->timer);
  auto cb = std::move(r->done);
  cb(s);
}

void Engine::WakeRoomWaiters(Tier tier) {
  std::vector<std::shared_ptr<RoomRequest>> waiters;
  {
    std::lock_guard dir(dir_mu_);
    waiters.swap(room_waiters_[T(tier)]);
  }
  for (auto& w : waiters) RoomStep(w);
}

void Engine::RoomStep(const std::shared_ptr<RoomRequest>& r) {
  if (r->finished.load()) return;
  const Tier tier = r->tier;
  if (RoomNow(tier, r->family, r->bytes)) return FinishRoom(r, Status::Ok());
  const Stage stage = tier == Tier::kGpu    ? Stage::kGpuRoom
                      : tier == Tier::kHost ? Stage::kHostRoom
                                            : Stage::kDiskRoom;
  if (tier == Tier::kDisk) {
    Refuse(stage, Refusal::kOom);
    return FinishRoom(
        r, Status(ErrorKind::kOom, "tier=disk: " + Human(r->bytes) +
                                       " do not fit in --disk-quota " + Human(disk_.limit()) +
                                       " (" + Human(disk_.used()) + " in use)"));
  }
  if (++r->rounds > 16) {
    Refuse(stage, Refusal::kOom);
    return FinishRoom(
        r, Status(ErrorKind::kOom, "tier=" + std::string(TierName(tier)) +
                                       ": demotions could not make room for " + Human(r->bytes)));
  }
  const uint64_t head = Headroom(tier, r->family);
  const uint64_t need = r->bytes > head ? r->bytes - head : 0;
  std::optional<Family> only;
  if (tier == Tier::kHost && opts_.host_headroom_any && opts_.host_headroom_any() >= r->bytes) {
    only = r->family;  // the family's cap binds: only its own objects help
  }
  // Demote a little more than asked, so a stream of writes does not wait on every one.
  const uint64_t slack = tier == Tier::kGpu ? gpu_.limit() / 64 : need / 4;
  uint64_t freed = 0;
  std::vector<Victim> victims = PickVictims(tier, only, need + slack, &freed, /*dirty=*/true);
  if (victims.empty()) {
    if (RoomNow(tier, r->family, r->bytes)) return FinishRoom(r, Status::Ok());
    {
      std::lock_guard dir(dir_mu_);
      if (demotions_in_flight_[T(tier)] > 0) {  // wait for those to land, then look again
        room_waiters_[T(tier)].push_back(r);
        room_waits_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
    }
    Refuse(stage, Refusal::kOom);
    const uint64_t limit_hint = tier == Tier::kGpu ? gpu_.limit() : 0;
    return FinishRoom(
        r, Status(ErrorKind::kOom,
                  "tier=" + std::string(TierName(tier)) + ": " + Human(r->bytes) +
                      " do not fit and nothing more can be demoted (" + Human(head) + " free" +
                      (tier == Tier::kGpu ? " of --gpu-memory " + Human(limit_hint) : "") +
                      "; the rest is pinned by requests in flight or being written)"));
  }
  uint64_t victim_bytes = 0;
  for (const Victim& v : victims) victim_bytes += v.obj->bytes();
  const Path path = tier == Tier::kHost ? kDiskWritePath : kDownloadPath;
  if (r->deadline != kNoDeadline) {
    const double est = meters_[path].Estimate(victim_bytes) * (tier == Tier::kHost ? 2.0 : 1.0);
    if (Clock::now() +
            std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(est)) >
        r->deadline) {
      Unmark(victims);
      EndPick(tier);
      Refuse(stage, Refusal::kDeadline);
      return FinishRoom(
          r, Status(ErrorKind::kTimeout,
                    "deadline cannot be met: making room for " + Human(r->bytes) + " in " +
                        std::string(TierName(tier)) + " means demoting " + Human(victim_bytes) +
                        (tier == Tier::kHost ? " to disk" : " to host") + ", estimated " + Ms(est) +
                        " at " + Rate(meters_[path].rate())));
    }
  }
  room_waits_.fetch_add(1, std::memory_order_relaxed);
  if (tier == Tier::kHost) {
    Spill(std::move(victims), r);
  } else {
    DownloadVictims(std::move(victims), r);
  }
  EndPick(tier);  // the jobs count themselves now
}

void Engine::Spill(std::vector<Victim> victims, std::shared_ptr<RoomRequest> r) {
  // One segment per kSpillSegmentBytes of victims, written by parallel jobs.
  std::vector<std::shared_ptr<std::vector<Victim>>> segments;
  uint64_t bytes = kSpillSegmentBytes;
  for (auto& v : victims) {
    if (bytes >= kSpillSegmentBytes) {
      segments.push_back(std::make_shared<std::vector<Victim>>());
      bytes = 0;
    }
    bytes += v.obj->bytes();
    segments.back()->push_back(std::move(v));
  }
  auto left = std::make_shared<std::atomic<size_t>>(segments.size());
  for (auto& seg : segments) SpillSegment(std::move(seg), r, left);
}

void Engine::SpillSegment(std::shared_ptr<std::vector<Victim>> seg, std::shared_ptr<RoomRequest> r,
                          std::shared_ptr<std::atomic<size_t>> left) {
  uint64_t seg_bytes = 0;
  for (const auto& v : *seg) seg_bytes += v.obj->bytes();
  {
    std::lock_guard dir(dir_mu_);
    ++demotions_in_flight_[T(Tier::kHost)];
  }
  meters_[kDiskWritePath].Queue(seg_bytes);
  auto job = [this, seg, seg_bytes, r, left]() {
    const auto t0 = Clock::now();
    std::vector<std::span<const uint8_t>> spans;
    std::vector<std::vector<uint32_t>> indexes(seg->size());
    for (size_t i = 0; i < seg->size(); ++i) {
      for (const auto& b : (*seg)[i].host->blocks) {
        indexes[i].push_back(static_cast<uint32_t>(spans.size()));
        spans.emplace_back(b->data(), b->size());
      }
    }
    const uint64_t seq = spill_seq_.fetch_add(1);
    const std::string name = "spill:" + std::to_string(getpid()) + ":" + std::to_string(seq);
    const std::string path = store::disk::ObjectPath(opts_.spill_dir, name, 1);
    const uint64_t file_bytes = store::disk::ObjectFileBytes("pion-spill v1", spans);
    Status s = disk_.Reserve(file_bytes);
    if (!s.ok()) {  // spill copies that memory makes redundant can go first
      ReclaimClean(Tier::kDisk, std::nullopt, file_bytes);
      s = disk_.Reserve(file_bytes);
    }
    const uint64_t reserved = s.ok() ? file_bytes : 0;
    std::shared_ptr<DiskFile> file;
    if (s.ok()) {
      s = store::disk::WriteObject(opts_.spill_dir, name, 1, "pion-spill v1", spans,
                                   {/*durable=*/false, /*remove_older=*/false});
    }
    if (s.ok()) {
      auto f = DiskFile::Open(path, DiskFile::Kind::kSpill, &disk_);
      if (f.ok()) {
        file = std::move(f).value();
      } else {
        s = f.status();
        unlink(path.c_str());
      }
    }
    disk_.Release(reserved);  // the open file carries the charge now
    // Validate: read every block back and compare it with what memory holds, before any host
    // copy goes (never free the last good copy first).
    std::vector<uint8_t> scratch;
    for (size_t i = 0; s.ok() && i < spans.size(); ++i) {
      scratch.resize(spans[i].size());
      s = file->ReadBlock(i, scratch.data());
      // (An empty block compares equal: memcmp takes no null pointer, even for no bytes.)
      if (s.ok() && !spans[i].empty() &&
          std::memcmp(scratch.data(), spans[i].data(), spans[i].size()) != 0) {
        s = Status(ErrorKind::kCorrupt, file->path() + ": a block read back differs");
      }
    }
    meters_[kDiskWritePath].Unqueue(seg_bytes);
    // No room on the disk (the quota, or a full file system) is no room for the demotion:
    // -OOM, as when everything is pinned. A failing device stays -IOERR.
    const bool no_room = s.kind() == ErrorKind::kOom || store::disk::IsNoSpace(s);
    if (s.ok()) {
      meters_[kDiskWritePath].Record(seg_bytes, Seconds(t0, Clock::now()));
      spill_files_.fetch_add(1, std::memory_order_relaxed);
    } else {
      Refuse(Stage::kDiskWrite, no_room ? Refusal::kOom : Refusal::kIo);
    }
    std::vector<std::shared_ptr<HostReplica>> dead;
    {
      std::lock_guard dir(dir_mu_);
      for (size_t i = 0; i < seg->size(); ++i) {
        Object* o = (*seg)[i].obj.get();
        std::lock_guard lock(o->mu_);
        o->moving_ = false;
        if (!s.ok() || o->generation_ != (*seg)[i].generation) continue;
        if (!o->disk_) {
          auto d = std::make_shared<DiskCopy>();
          d->file = file;
          d->blocks = std::move(indexes[i]);
          o->disk_ = std::move(d);
          LinkLocked(o, Tier::kDisk);
        }
        // A reader that pinned it meanwhile keeps the host copy, now clean.
        if (o->pins_[T(Tier::kHost)] == 0 && !o->writing_ && o->host_) {
          dead.push_back(std::move(o->host_));
          UnlinkLocked(o, Tier::kHost);
          demotions_[T(Tier::kHost)][T(Tier::kDisk)].fetch_add(1, std::memory_order_relaxed);
          demotion_bytes_[T(Tier::kHost)][T(Tier::kDisk)].fetch_add(o->bytes_,
                                                                    std::memory_order_relaxed);
        }
      }
      --demotions_in_flight_[T(Tier::kHost)];
    }
    for (auto& v : *seg) v.host.reset();
    dead.clear();  // the host bytes go back to the budget here
    file.reset();
    if (!s.ok()) {
      FinishRoom(r, Status(no_room ? ErrorKind::kOom : ErrorKind::kIo,
                           "tier=host: demotion to disk failed, nothing was lost: " + s.message()));
    }
    if (left->fetch_sub(1) == 1) RoomStep(r);
    WakeRoomWaiters(Tier::kHost);
  };
  if (!opts_.run_io || !opts_.run_io(job)) {
    // The I/O queue is full: run nothing, lose nothing.
    {
      std::lock_guard dir(dir_mu_);
      --demotions_in_flight_[T(Tier::kHost)];
    }
    meters_[kDiskWritePath].Unqueue(seg_bytes);
    Unmark(*seg);
    Refuse(Stage::kDiskWrite, Refusal::kCredits);
    FinishRoom(r, Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later"));
    left->fetch_sub(1);
  }
}

void Engine::DownloadVictims(std::vector<Victim> victims, std::shared_ptr<RoomRequest> r) {
  // Each GPU-only victim gets a host copy first (its own room made first), then loses its GPU
  // copy once no kernel reads it.
  auto left = std::make_shared<std::atomic<size_t>>(victims.size());
  {
    std::lock_guard dir(dir_mu_);
    demotions_in_flight_[T(Tier::kGpu)] += static_cast<uint32_t>(victims.size());
  }
  for (auto& v : victims) {
    auto finish_one = [this, r, left, obj = v.obj](const Status& s) {
      {
        std::lock_guard dir(dir_mu_);
        --demotions_in_flight_[T(Tier::kGpu)];
      }
      if (!s.ok()) {
        std::lock_guard lock(obj->mu_);
        obj->moving_ = false;
      }
      if (left->fetch_sub(1) == 1) RoomStep(r);
      WakeRoomWaiters(Tier::kGpu);
    };
    const Family f = v.obj->family();
    const uint64_t bytes = v.obj->bytes();
    MakeRoom(Tier::kHost, f, bytes, r->deadline,
             [this, v, f, bytes, finish_one](const Status& room) {
               if (!room.ok()) return finish_one(room);
               auto charge = ReserveHost(f, bytes);
               if (!charge.ok()) return finish_one(charge.status());
               auto job = [this, v, finish_one,
                           charge = std::make_shared<std::unique_ptr<Charge>>(
                               std::move(charge).value())]() mutable {
                 const auto t0 = Clock::now();
                 auto host = Download(v.obj.get(), *v.gpu, std::move(*charge));
                 if (!host.ok()) {
                   Refuse(Stage::kGpuDownload, Refusal::kIo);
                   return finish_one(host.status());
                 }
                 meters_[kDownloadPath].Record(v.obj->bytes(), Seconds(t0, Clock::now()));
                 std::shared_ptr<GpuReplica> dead;
                 {
                   std::lock_guard dir(dir_mu_);
                   Object* o = v.obj.get();
                   std::lock_guard lock(o->mu_);
                   o->moving_ = false;
                   if (o->generation_ == v.generation && !o->host_) {
                     o->host_ = std::move(host).value();
                     LinkLocked(o, Tier::kHost);
                   }
                   if (o->host_ && o->gpu_ == v.gpu && o->gpu_->readers() == 0 &&
                       o->pins_[T(Tier::kGpu)] == 0) {
                     dead = std::move(o->gpu_);
                     UnlinkLocked(o, Tier::kGpu);
                     demotions_[T(Tier::kGpu)][T(Tier::kHost)].fetch_add(1);
                     demotion_bytes_[T(Tier::kGpu)][T(Tier::kHost)].fetch_add(o->bytes_);
                   }
                 }
                 finish_one(Status::Ok());
               };
               if (!opts_.run_gpu || !opts_.run_gpu(job)) {
                 Refuse(Stage::kGpuDownload, Refusal::kCredits);
                 finish_one(Status(ErrorKind::kBusy, "the GPU copy queue is full; retry later"));
               }
             });
  }
}

void Engine::SetGpuLimit(uint64_t bytes) {
  gpu_.set_limit(bytes);
  const uint64_t used = gpu_.used();
  if (used <= bytes) return;
  // Over the new limit: copies with a host copy beside them go now; GPU-only ones are
  // downloaded first (then at least the rest of the excess is demoted, asynchronously).
  const uint64_t over = used - bytes;
  if (ReclaimClean(Tier::kGpu, std::nullopt, over) >= over) return;
  const uint64_t now = gpu_.used();
  if (now > bytes) {
    MakeRoom(Tier::kGpu, Family::kAttention, now - bytes, kNoDeadline, [](const Status&) {});
  }
}

bool Engine::ReserveGpuExtra(uint64_t bytes) {
  if (gpu_.TryReserve(bytes)) return true;
  const uint64_t f = gpu_.free();
  ReclaimClean(Tier::kGpu, std::nullopt, bytes > f ? bytes - f : bytes);
  return gpu_.TryReserve(bytes);
}

// ---- Residency ----------------------------------------------------------------------------

bool Engine::TryPinAll(const std::vector<ObjectRef>& objs, Tier tier, PinSet* pins) {
  PinSet got;
  for (const auto& o : objs) {
    if (!got.TryPin(o, tier)) return false;  // `got` unpins what it took
  }
  pins->Merge(std::move(got));
  return true;
}

double Engine::EstimateSeconds(const std::vector<ObjectRef>& objs, Tier tier) const {
  uint64_t from_disk = 0, upload = 0;
  for (const auto& o : objs) {
    const unsigned tiers = o->Tiers();
    if (tiers & (1u << T(tier))) continue;
    const bool on_host = tiers & (1u << T(Tier::kHost));
    if (!on_host && (tiers & (1u << T(Tier::kDisk)))) from_disk += o->bytes();
    if (tier == Tier::kGpu) upload += o->bytes();
  }
  double s = 0;
  if (from_disk > 0) s += meters_[kDiskReadPath].Estimate(from_disk);
  if (upload > 0) s += meters_[kUploadPath].Estimate(upload);
  return s;
}

void Engine::Require(std::vector<ObjectRef> objs, Tier tier, Deadline deadline, PinnedDone done) {
  RequireImpl(std::move(objs), tier, deadline, std::move(done), /*admission=*/true);
}

void Engine::RequireImpl(std::vector<ObjectRef> objs, Tier tier, Deadline deadline, PinnedDone done,
                         bool admission) {
  PinSet pins;
  std::vector<ObjectRef> missing;
  uint64_t missing_bytes = 0;
  for (auto& o : objs) {
    if (pins.TryPin(o, tier)) continue;
    missing_bytes += o->bytes();
    missing.push_back(std::move(o));
  }
  if (missing.empty()) return done(Status::Ok(), std::move(pins));
  // Admission: a deadline the transfer cannot meet is refused now, not after the wait.
  if (deadline != kNoDeadline) {
    const double est = EstimateSeconds(missing, tier);
    const auto finish = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(est));
    if (finish > deadline) {
      const Stage stage = tier == Tier::kGpu ? Stage::kGpuUpload : Stage::kDiskRead;
      Refuse(stage, Refusal::kDeadline);
      const double left_ms =
          std::chrono::duration<double, std::milli>(deadline - Clock::now()).count();
      char left[32];
      std::snprintf(left, sizeof(left), "%.1f ms", std::max(0.0, left_ms));
      return done(
          Status(ErrorKind::kTimeout,
                 "deadline cannot be met: promoting " + Human(missing_bytes) + " to " +
                     std::string(TierName(tier)) + " is estimated at " + Ms(est) + " (" +
                     std::string(StageName(stage)) + " at " +
                     Rate(meters_[tier == Tier::kGpu ? kUploadPath : kDiskReadPath].rate()) +
                     "), " + left + " left"),
          PinSet());
    }
  }
  // Credits: bytes of promotions in flight (a promotion's own first hop is not a new request).
  const uint64_t inflight = inflight_bytes_.load(std::memory_order_relaxed);
  if (admission && inflight > 0 && inflight + missing_bytes > opts_.promotion_credits) {
    Refuse(Stage::kPromotionQueue, Refusal::kCredits);
    return done(Status(ErrorKind::kBusy, "promotion queue full: " + Human(inflight) +
                                             " in flight of " + Human(opts_.promotion_credits) +
                                             " credits (--promotion-credits), " +
                                             Human(missing_bytes) + " more asked; retry later"),
                PinSet());
  }
  auto join = std::make_shared<Join>();
  join->done = std::move(done);
  join->tier = tier;
  join->left = missing.size();
  join->pins = std::move(pins);
  join->timers = &timers_;
  if (deadline != kNoDeadline) {
    std::weak_ptr<Join> w = join;
    const Stage stage = tier == Tier::kGpu ? Stage::kGpuUpload : Stage::kDiskRead;
    join->timer = timers_.Add(deadline, [this, w, stage, missing_bytes, tier] {
      if (auto j = w.lock()) {
        Refuse(stage, Refusal::kDeadline);
        j->Expire(Status(ErrorKind::kTimeout,
                         "deadline passed while promoting " + Human(missing_bytes) + " to " +
                             std::string(TierName(tier)) + " (" + std::string(StageName(stage)) +
                             "); the transfer goes on for other readers"));
      }
    });
  }
  for (const auto& o : missing) JoinTransfer(o, tier, join);
}

void Engine::JoinTransfer(const ObjectRef& obj, Tier tier, const std::shared_ptr<Join>& join) {
  auto cb = [join, obj](const Status& s) { join->Arrive(s, obj); };
  std::shared_ptr<Transfer> start;
  {
    std::lock_guard lock(obj->mu_);
    const bool resident = tier == Tier::kGpu ? obj->gpu_ != nullptr : obj->host_ != nullptr;
    if (resident) {
      ++obj->pins_[T(tier)];
    } else if (!obj->lost_.empty()) {
      // fallthrough below with an error
    } else if (auto& t = obj->promoting_[T(tier)]) {
      t->waiters.push_back(std::move(cb));
      coalesced_.fetch_add(1, std::memory_order_relaxed);
      return;
    } else {
      t = std::make_shared<Transfer>();
      t->obj = obj;
      t->to = tier;
      t->generation = obj->generation_;
      t->waiters.push_back(std::move(cb));
      start = t;
    }
  }
  if (start) {
    inflight_bytes_.fetch_add(obj->bytes(), std::memory_order_relaxed);
    return StartTransfer(start);
  }
  const std::string lost = obj->lost();
  if (!lost.empty()) return join->Arrive(Status(ErrorKind::kCorrupt, lost), obj);
  join->Arrive(Status::Ok(), obj);  // became resident meanwhile: pinned above
}

void Engine::StartTransfer(const std::shared_ptr<Transfer>& t) {
  Object* o = t->obj.get();
  if (t->to == Tier::kHost) {
    bool on_disk, on_gpu;
    {
      std::lock_guard lock(o->mu_);
      on_disk = o->disk_ != nullptr;
      on_gpu = o->gpu_ != nullptr;
    }
    if (on_gpu) return GpuToHost(t, false);
    if (on_disk) return DiskToHost(t, false);
    return FailTransfer(t, Status(ErrorKind::kCorrupt, "object has no copy in any tier"));
  }
  // To the GPU: from the host copy, bringing it in from disk first when needed.
  PinSet host;
  if (host.TryPin(t->obj, Tier::kHost)) return HostToGpu(t, std::move(host), false);
  std::vector<ObjectRef> one{t->obj};
  RequireImpl(
      std::move(one), Tier::kHost, kNoDeadline,
      [this, t](const Status& s, PinSet pins) {
        if (!s.ok()) return FailTransfer(t, s);
        HostToGpu(t, std::move(pins), false);
      },
      /*admission=*/false);
}

void Engine::DiskToHost(const std::shared_ptr<Transfer>& t, bool room_made) {
  Object* o = t->obj.get();
  const Family f = o->family_;
  auto charge = ReserveHost(f, o->bytes_);
  if (!charge.ok()) {
    if (room_made && ++t->attempts > 4) return FailTransfer(t, charge.status());
    return MakeRoom(Tier::kHost, f, o->bytes_, kNoDeadline, [this, t](const Status& s) {
      if (!s.ok()) return FailTransfer(t, s);
      DiskToHost(t, true);
    });
  }
  std::shared_ptr<DiskCopy> src;
  {
    std::lock_guard lock(o->mu_);
    src = o->disk_;
  }
  if (!src) return FailTransfer(t, Status(ErrorKind::kCorrupt, "object lost its disk copy"));
  meters_[kDiskReadPath].Queue(o->bytes_);
  // The blocks of one object are read in parallel across the I/O threads when they are large
  // (an attention slot's K and V): the last job to finish publishes.
  struct Read {
    std::vector<BufferRef> blocks;
    std::vector<Status> status;
    std::atomic<size_t> left{0};
    std::unique_ptr<Charge> charge;
    Clock::time_point t0 = Clock::now();
  };
  auto rd = std::make_shared<Read>();
  rd->blocks.resize(o->sizes_.size());
  rd->status.resize(o->sizes_.size());
  rd->charge = std::move(charge).value();
  std::vector<std::vector<size_t>> jobs;
  constexpr uint64_t kParallelBlock = 1 << 20;
  for (size_t i = 0; i < o->sizes_.size(); ++i) {
    if (jobs.empty() || o->sizes_[i] >= kParallelBlock) jobs.emplace_back();
    jobs.back().push_back(i);
  }
  rd->left.store(jobs.size());
  auto finish = [this, t, src, rd]() {
    Object* o = t->obj.get();
    Status s;
    for (const Status& x : rd->status) {
      if (s.ok() && !x.ok()) s = x;
    }
    meters_[kDiskReadPath].Unqueue(o->bytes_);
    if (!s.ok()) {
      if (s.kind() == ErrorKind::kCorrupt) {
        corrupt_.fetch_add(1, std::memory_order_relaxed);
        Refuse(Stage::kDiskRead, Refusal::kCorrupt);
        std::shared_ptr<DiskCopy> dead;
        std::lock_guard dir(dir_mu_);
        std::lock_guard lock(o->mu_);
        if (o->disk_ == src) {  // the copy is bad: never read it again
          dead = std::move(o->disk_);
          UnlinkLocked(o, Tier::kDisk);
          if (!o->host_ && !o->gpu_) {
            o->lost_ = s.message();
            lost_.fetch_add(1, std::memory_order_relaxed);
            if (o->loss_counter_) o->loss_counter_->fetch_add(1, std::memory_order_relaxed);
          }
        }
      } else if (s.kind() == ErrorKind::kBusy) {
        Refuse(Stage::kDiskRead, Refusal::kCredits);
      } else {
        Refuse(Stage::kDiskRead, Refusal::kIo);
      }
      return FailTransfer(t, s);
    }
    meters_[kDiskReadPath].Record(o->bytes_, Seconds(rd->t0, Clock::now()));
    auto h = std::make_shared<HostReplica>();
    h->blocks = std::move(rd->blocks);
    h->charge = std::move(rd->charge);
    CompleteHost(t, std::move(h), Tier::kDisk);
  };
  for (auto& idx : jobs) {
    auto job = [this, t, src, rd, idx, finish]() {
      Object* o = t->obj.get();
      for (size_t i : idx) {
        auto b = o->alloc_->Allocate(o->sizes_[i]);
        if (!b.ok()) {
          rd->status[i] = b.status();
          continue;
        }
        Status s = src->file->ReadBlock(src->blocks[i], b.value()->data());
        backend_reads_.fetch_add(1, std::memory_order_relaxed);
        if (s.ok() && src->file->file().block_length(src->blocks[i]) != o->sizes_[i]) {
          s = Status(ErrorKind::kCorrupt, src->file->path() + ": block has the wrong size");
        }
        rd->status[i] = s;
        rd->blocks[i] = std::move(b).value();
      }
      if (rd->left.fetch_sub(1) == 1) finish();
    };
    if (!opts_.run_io || !opts_.run_io(job)) {
      for (size_t i : idx) {
        rd->status[i] = Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later");
      }
      if (rd->left.fetch_sub(1) == 1) finish();
    }
  }
}

void Engine::GpuToHost(const std::shared_ptr<Transfer>& t, bool room_made) {
  Object* o = t->obj.get();
  auto charge = ReserveHost(o->family_, o->bytes_);
  if (!charge.ok()) {
    if (room_made && ++t->attempts > 4) return FailTransfer(t, charge.status());
    return MakeRoom(Tier::kHost, o->family_, o->bytes_, kNoDeadline, [this, t](const Status& s) {
      if (!s.ok()) return FailTransfer(t, s);
      GpuToHost(t, true);
    });
  }
  GpuPin pin = o->Gpu();
  if (!pin) return DiskToHost(t, false);  // went meanwhile: read the disk copy instead
  auto state = std::make_shared<std::pair<GpuPin, std::unique_ptr<Charge>>>(
      std::move(pin), std::move(charge).value());
  auto job = [this, t, state]() {
    const auto t0 = Clock::now();
    auto host = Download(t->obj.get(), *state->first, std::move(state->second));
    state->first.Reset();
    if (!host.ok()) {
      Refuse(Stage::kGpuDownload, Refusal::kIo);
      return FailTransfer(t, host.status());
    }
    meters_[kDownloadPath].Record(t->obj->bytes_, Seconds(t0, Clock::now()));
    CompleteHost(t, std::move(host).value(), Tier::kGpu);
  };
  if (!opts_.run_gpu || !opts_.run_gpu(job)) {
    Refuse(Stage::kGpuDownload, Refusal::kCredits);
    FailTransfer(t, Status(ErrorKind::kBusy, "the GPU copy queue is full; retry later"));
  }
}

void Engine::HostToGpu(const std::shared_ptr<Transfer>& t, PinSet host_pins, bool room_made) {
  Object* o = t->obj.get();
  if (!gpu_.TryReserve(o->bytes_)) {
    if (o->bytes_ > gpu_.limit()) {
      Refuse(Stage::kGpuRoom, Refusal::kOom);
      return FailTransfer(t, Status(ErrorKind::kOom, "tier=gpu: " + Human(o->bytes_) +
                                                         " are more than all of --gpu-memory " +
                                                         Human(gpu_.limit())));
    }
    if (room_made && ++t->attempts > 4) {
      Refuse(Stage::kGpuRoom, Refusal::kOom);
      return FailTransfer(t, Status(ErrorKind::kOom, "tier=gpu: room for " + Human(o->bytes_) +
                                                         " was taken by other promotions; "
                                                         "retry"));
    }
    auto pins = std::make_shared<PinSet>(std::move(host_pins));
    return MakeRoom(Tier::kGpu, o->family_, o->bytes_, kNoDeadline,
                    [this, t, pins](const Status& s) {
                      if (!s.ok()) return FailTransfer(t, s);
                      HostToGpu(t, std::move(*pins), true);
                    });
  }
  std::vector<BufferRef> src;
  if (!o->HostBlocks(&src)) {
    gpu_.Release(o->bytes_);
    return FailTransfer(t, Status(ErrorKind::kMiss, "host copy went during the promotion"));
  }
  meters_[kUploadPath].Queue(o->bytes_);
  auto pins = std::make_shared<PinSet>(std::move(host_pins));
  auto job = [this, t, src = std::move(src), pins]() {
    Object* o = t->obj.get();
    const auto t0 = Clock::now();
    auto g = Upload(*o, src);
    meters_[kUploadPath].Unqueue(o->bytes_);
    pins->Reset();
    if (!g.ok()) {
      gpu_.Release(o->bytes_);
      Refuse(Stage::kGpuUpload,
             g.status().kind() == ErrorKind::kOom ? Refusal::kOom : Refusal::kIo);
      return FailTransfer(t, g.status());
    }
    meters_[kUploadPath].Record(o->bytes_, Seconds(t0, Clock::now()));
    CompleteGpu(t, std::move(g).value());
  };
  if (!opts_.run_gpu || !opts_.run_gpu(job)) {
    gpu_.Release(o->bytes_);
    meters_[kUploadPath].Unqueue(o->bytes_);
    Refuse(Stage::kGpuUpload, Refusal::kCredits);
    FailTransfer(t, Status(ErrorKind::kBusy, "the GPU copy queue is full; retry later"));
  }
}

StatusOr<std::shared_ptr<GpuReplica>> Engine::Upload(const Object& o,
                                                     const std::vector<BufferRef>& src) {
  const faults::Fault f = faults::CheckAndDelay(faults::Point::kGpuCopy, "gpu");
  if (f.action != faults::Action::kNone) {
    return Status(ErrorKind::kDevice, "GPU copy failed (fault injection)");
  }
  // Blocks at gpu::SpanOffsets (each 256-byte aligned, as Upload places them); the padding,
  // under 256 bytes a block, is not charged to the GPU budget.
  uint64_t padded = 0;
  std::vector<uint64_t> offsets = gpu::SpanOffsets(o.sizes_, &padded);
  auto mem = gpu::Allocate(padded);
  if (!mem.ok()) return mem.status();
  auto g = std::make_shared<GpuReplica>(std::move(mem).value(), offsets, &gpu_, o.bytes_);
  const uint64_t fence = g->memory().id();
  std::vector<gpu::HostSpan> spans;
  for (size_t i = 0; i < src.size(); ++i) spans.push_back({src[i]->data(), o.sizes_[i]});
  Status s = gpu::Upload(g->memory(), spans, &g->mutable_ready());
  if (s.ok() && g->memory().id() != fence) {
    s = Status(ErrorKind::kDevice, "GPU copy completed into a reused allocation");
  }
  if (!s.ok()) {
    g->charged_ = 0;  // the caller releases the reservation
    return s;
  }
  return g;
}

StatusOr<std::shared_ptr<HostReplica>> Engine::Download(Object* o, const GpuReplica& g,
                                                        std::unique_ptr<Charge> charge) {
  const faults::Fault f = faults::CheckAndDelay(faults::Point::kGpuCopy, "gpu");
  if (f.action != faults::Action::kNone) {
    return Status(ErrorKind::kDevice, "GPU copy failed (fault injection)");
  }
  auto h = std::make_shared<HostReplica>();
  for (size_t i = 0; i < o->sizes_.size(); ++i) {
    auto b = o->alloc_->Allocate(o->sizes_[i]);
    if (!b.ok()) return b.status();
    Status s = gpu::Download(b.value()->data(), g.block(i), o->sizes_[i]);
    if (!s.ok()) return s;
    h->blocks.push_back(std::move(b).value());
  }
  h->charge = std::move(charge);
  return h;
}

void Engine::CompleteHost(const std::shared_ptr<Transfer>& t, std::shared_ptr<HostReplica> r,
                          Tier from) {
  Object* o = t->obj.get();
  std::vector<std::function<void(const Status&)>> waiters;
  bool stale = false;
  {
    std::lock_guard dir(dir_mu_);
    std::lock_guard lock(o->mu_);
    if (o->promoting_[T(Tier::kHost)] != t) return;  // superseded: a stale completion
    o->promoting_[T(Tier::kHost)] = nullptr;
    waiters = std::move(t->waiters);
    if (o->generation_ != t->generation) {
      stale = true;
    } else {
      if (!o->host_) {
        o->host_ = std::move(r);
        LinkLocked(o, Tier::kHost);
      }
      o->pins_[T(Tier::kHost)] += static_cast<uint32_t>(waiters.size());
    }
  }
  inflight_bytes_.fetch_sub(o->bytes_, std::memory_order_relaxed);
  if (stale) {
    for (auto& w : waiters) {
      w(Status(ErrorKind::kMiss, "the object changed during its promotion; retry"));
    }
    return;
  }
  promotions_[T(from)][T(Tier::kHost)].fetch_add(1, std::memory_order_relaxed);
  promotion_bytes_[T(from)][T(Tier::kHost)].fetch_add(o->bytes_, std::memory_order_relaxed);
  for (auto& w : waiters) w(Status::Ok());
}

void Engine::CompleteGpu(const std::shared_ptr<Transfer>& t, std::shared_ptr<GpuReplica> r) {
  Object* o = t->obj.get();
  std::vector<std::function<void(const Status&)>> waiters;
  std::shared_ptr<GpuReplica> unused;
  bool stale = false;
  {
    std::lock_guard dir(dir_mu_);
    std::lock_guard lock(o->mu_);
    if (o->promoting_[T(Tier::kGpu)] != t) return;
    o->promoting_[T(Tier::kGpu)] = nullptr;
    waiters = std::move(t->waiters);
    if (o->generation_ != t->generation) {
      stale = true;
      unused = std::move(r);
    } else if (!o->gpu_) {
      o->gpu_ = std::move(r);
      LinkLocked(o, Tier::kGpu);
    } else {
      unused = std::move(r);
    }
    if (!stale) o->pins_[T(Tier::kGpu)] += static_cast<uint32_t>(waiters.size());
  }
  unused.reset();
  inflight_bytes_.fetch_sub(o->bytes_, std::memory_order_relaxed);
  if (stale) {
    for (auto& w : waiters) {
      w(Status(ErrorKind::kMiss, "the object changed during its promotion; retry"));
    }
    return;
  }
  promotions_[T(Tier::kHost)][T(Tier::kGpu)].fetch_add(1, std::memory_order_relaxed);
  promotion_bytes_[T(Tier::kHost)][T(Tier::kGpu)].fetch_add(o->bytes_, std::memory_order_relaxed);
  for (auto& w : waiters) w(Status::Ok());
}

void Engine::FailTransfer(const std::shared_ptr<Transfer>& t, const Status& s) {
  Object* o = t->obj.get();
  std::vector<std::function<void(const Status&)>> waiters;
  {
    std::lock_guard lock(o->mu_);
    if (o->promoting_[T(t->to)] != t) return;
    o->promoting_[T(t->to)] = nullptr;
    waiters = std::move(t->waiters);
  }
  inflight_bytes_.fetch_sub(o->bytes_, std::memory_order_relaxed);
  for (auto& w : waiters) w(s);
}

// ---- Disk copies ----------------------------------------------------------------------------

StatusOr<std::shared_ptr<DiskFile>> Engine::WriteSaved(
    const std::string& dir, std::string_view name, uint64_t version, std::string_view meta,
    const std::vector<std::span<const uint8_t>>& blocks) {
  std::vector<SaveItem> items(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    items[i].bytes.assign(reinterpret_cast<const char*>(blocks[i].data()), blocks[i].size());
  }
  std::vector<std::vector<uint32_t>> unused;
  return WriteSaved(dir, name, version, meta, items, &unused);
}

StatusOr<std::shared_ptr<DiskFile>> Engine::WriteSaved(
    const std::string& dir, std::string_view name, uint64_t version, std::string_view meta,
    const std::vector<SaveItem>& items, std::vector<std::vector<uint32_t>>* object_blocks) {
  std::vector<store::disk::BlockSource> src;
  std::vector<BufferRef> held;                                  // host blocks being written
  std::vector<std::shared_ptr<DiskCopy>> disk_held;             // disk copies being read
  std::vector<std::shared_ptr<std::vector<uint8_t>>> gpu_held;  // GPU blocks brought down
  object_blocks->assign(items.size(), {});
  uint64_t bytes = 28 + meta.size() + 16;
  for (size_t i = 0; i < items.size(); ++i) {
    const SaveItem& it = items[i];
    if (!it.obj) {
      store::disk::BlockSource b;
      b.length = it.bytes.size();
      b.data = reinterpret_cast<const uint8_t*>(it.bytes.data());
      src.push_back(std::move(b));
      continue;
    }
    Object* o = it.obj.get();
    std::vector<BufferRef> host;
    std::shared_ptr<DiskCopy> disk;
    GpuPin gpu;
    if (!o->HostBlocks(&host)) {
      {
        std::lock_guard lock(o->mu_);
        disk = o->disk_;
      }
      if (!disk) gpu = o->Gpu();
      if (!disk && !gpu) {
        const std::string lost = o->lost();
        return Status(ErrorKind::kCorrupt,
                      lost.empty() ? "an object has no copy in any tier" : lost);
      }
    }
    for (size_t k = 0; k < o->sizes_.size(); ++k) {
      (*object_blocks)[i].push_back(static_cast<uint32_t>(src.size()));
      store::disk::BlockSource b;
      b.length = o->sizes_[k];
      if (!host.empty()) {
        b.data = host[k]->data();
        held.push_back(host[k]);
      } else if (disk) {
        b.hash = disk->file->file().block_hash(disk->blocks[k]);
        b.hashed = true;
        b.read = [this, disk, blk = disk->blocks[k]](uint8_t* out) {
          backend_reads_.fetch_add(1, std::memory_order_relaxed);
          return disk->file->ReadBlock(blk, out);
        };
      } else {
        auto buf = std::make_shared<std::vector<uint8_t>>(o->sizes_[k]);
        Status s = gpu::Download(buf->data(), gpu->block(k), o->sizes_[k]);
        if (!s.ok()) return s;
        b.data = buf->data();
        gpu_held.push_back(std::move(buf));
      }
      src.push_back(std::move(b));
    }
    if (disk) disk_held.push_back(std::move(disk));
  }
  for (const auto& b : src) bytes += 16 + b.length;
  bytes += 8;
  Status s = disk_.Reserve(bytes);
  if (!s.ok()) {
    // Redundant spill copies are the one thing on disk that can go for a save.
    ReclaimClean(Tier::kDisk, std::nullopt, bytes);
    s = disk_.Reserve(bytes);
  }
  if (!s.ok()) {
    Refuse(Stage::kDiskRoom, Refusal::kOom);
    return s;
  }
  const auto t0 = Clock::now();
  s = store::disk::WriteObjectFrom(dir, name, version, meta, src);
  if (!s.ok()) {
    disk_.Release(bytes);
    Refuse(Stage::kDiskWrite, s.kind() == ErrorKind::kCorrupt ? Refusal::kCorrupt : Refusal::kIo);
    return s;
  }
  meters_[kDiskWritePath].Record(bytes, Seconds(t0, Clock::now()));
  auto f =
      DiskFile::Open(store::disk::ObjectPath(dir, name, version), DiskFile::Kind::kSaved, &disk_);
  disk_.Release(bytes);  // the open file carries the charge now
  return f;
}

StatusOr<std::shared_ptr<DiskFile>> Engine::OpenSaved(const std::string& path) {
  return DiskFile::Open(path, DiskFile::Kind::kSaved, &disk_);
}

void Engine::AttachDisk(const ObjectRef& obj, uint64_t generation, std::shared_ptr<DiskFile> file,
                        std::vector<uint32_t> blocks) {
  auto d = std::make_shared<DiskCopy>();
  d->file = std::move(file);
  d->blocks = std::move(blocks);
  std::shared_ptr<DiskCopy> old;
  std::lock_guard dir(dir_mu_);
  std::lock_guard lock(obj->mu_);
  if (obj->generation_ != generation || obj->writing_) return;
  old = std::move(obj->disk_);
  obj->disk_ = std::move(d);
  LinkLocked(obj.get(), Tier::kDisk);
}

// ---- Counters ----------------------------------------------------------------------------

Engine::Stats Engine::stats() const {
  Stats s;
  {
    std::lock_guard dir(dir_mu_);
    for (int t = 0; t < kTierCount; ++t) s.tiers[t] = {lists_[t].count, lists_[t].bytes};
  }
  for (int a = 0; a < kTierCount; ++a) {
    for (int b = 0; b < kTierCount; ++b) {
      s.promotions[a][b] = promotions_[a][b].load(std::memory_order_relaxed);
      s.promotion_bytes[a][b] = promotion_bytes_[a][b].load(std::memory_order_relaxed);
      s.demotions[a][b] = demotions_[a][b].load(std::memory_order_relaxed);
      s.demotion_bytes[a][b] = demotion_bytes_[a][b].load(std::memory_order_relaxed);
    }
    s.drops[a] = drops_[a].load(std::memory_order_relaxed);
  }
  s.backend_reads = backend_reads_.load();
  s.coalesced = coalesced_.load();
  s.room_waits = room_waits_.load();
  s.corrupt_replicas = corrupt_.load();
  s.lost_objects = lost_.load();
  s.spill_files = spill_files_.load();
  s.inflight_promotion_bytes = inflight_bytes_.load();
  s.promotion_credits = opts_.promotion_credits;
  for (int a = 0; a < kStageCount; ++a) {
    for (int b = 0; b < kRefusalCount; ++b) s.refusals[a][b] = refusals_[a][b].load();
  }
  for (int p = 0; p < 4; ++p) {
    s.rate[p] = meters_[p].rate();
    s.rate_measured[p] = meters_[p].samples() > 0;
  }
  return s;
}

}  // namespace pion::residency
