// Engine: the one place residency lives. A directory of objects (object.h) over three tiers —
// GPU memory (--gpu-memory), host memory (--maxmemory, per family), disk (--disk-quota) — with
// an LRU per tier, demotion GPU -> host -> disk under pressure, promotion back on use, and the
// admission rules that keep it bounded (seed 004 §0x04, §0x08H–0x08L, §0x09K).
//
// Moves (all reserve -> copy -> validate -> publish):
//   host -> disk   the victims' blocks are written into a spill segment on an I/O thread, read
//                  back and verified against their checksums, and only then does the object
//                  get its disk copy and lose its host copy. A victim with a valid lower copy
//                  (a save, an earlier spill, a GPU copy) is dropped without I/O.
//   GPU -> host    a device-to-host copy into newly charged host buffers, then the GPU copy
//                  goes once no kernel holds it.
//   disk -> host   blocks read and checksum-verified on an I/O thread into newly charged
//                  buffers (in the object's allocator: a tenant's shared-memory arena).
//   host -> GPU    an upload through pinned staging, checked against the allocation's id.
// Concurrent requests for one object and tier share one transfer (coalescing, §0x04D), so N
// readers of a cold object cause one read of each of its blocks.
//
// Admission: a Require/MakeRoom with a deadline is refused at once (kTimeout, naming the stage)
// when the transfer it needs cannot finish in time at the path's measured rate; one admitted
// but not finished at the deadline is answered kTimeout then, while the transfer goes on for
// its other waiters. Promotions in flight are bounded by credits (bytes, --promotion-credits):
// beyond them kBusy. Nothing is queued without bound. Every refusal is counted by stage.
//
// Threads: every method is thread-safe. Callbacks (Done) run on an I/O thread, a GPU-copy
// thread, the timer thread, or inline in the call; families post them to their shard. Locks:
// dir_mu_ (the tier lists) before any Object::mu_; no callback, allocation or I/O runs under a
// lock.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/byte_budget.h"
#include "common/status.h"
#include "residency/disk_file.h"
#include "residency/gpu_replica.h"
#include "residency/meter.h"
#include "residency/object.h"
#include "residency/tier.h"
#include "residency/timer_queue.h"

namespace pion::residency {

struct EngineOptions {
  uint64_t gpu_limit = 0;   // bytes of GPU replicas; 0 = no GPU tier
  uint64_t disk_quota = 0;  // bytes of saved and spill files; 0 = no limit
  std::string spill_dir;    // where spill segments go (emptied at start: they never outlive us)
  // Bytes of promotions in flight before new ones are refused (kBusy). One request larger than
  // this is still admitted when nothing else is in flight.
  uint64_t promotion_credits = 2ull << 30;
  // Host memory per family (the server's MemoryAccountant): reserve may drop clean replicas
  // through the accountant's reclaimer; headroom(f) is what f may still reserve, headroom_any
  // what any family may (--maxmemory).
  std::array<ByteBudget, kFamilyCount> host;
  std::function<uint64_t(Family)> host_headroom;
  std::function<uint64_t()> host_headroom_any;
  // Blocking work: disk I/O (--io-threads) and GPU copies. False when their queue is full.
  std::function<bool(std::function<void()>)> run_io;
  std::function<bool(std::function<void()>)> run_gpu;
};

class Engine {
 public:
  using Done = std::function<void(const Status&)>;
  using PinnedDone = std::function<void(const Status&, PinSet)>;

  explicit Engine(EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Creates the spill directory (removing what a previous process left there).
  Status Start();

  // ---- Objects -----------------------------------------------------------------------------
  // A new host-resident object whose blocks the caller filled; `charge` holds their host bytes
  // (from ReserveHost). `alloc` is where a later promotion allocates its host blocks.
  ObjectRef CreateInHost(Family f, std::vector<BufferRef> blocks, std::unique_ptr<Charge> charge,
                         BufferAllocator* alloc = BufferAllocator::Default());
  // An object known only by its copy in `file` (blocks[i] holds block i): found at start-up,
  // or opened from a saved file. Nothing is read until it is promoted.
  ObjectRef CreateOnDisk(Family f, std::vector<uint64_t> sizes, std::shared_ptr<DiskFile> file,
                         std::vector<uint32_t> blocks,
                         BufferAllocator* alloc = BufferAllocator::Default());

  // Host bytes for a new object of family f, reserved now (clean replicas are dropped to make
  // room); kOom when they do not fit without demotions (MakeRoom then waits for those).
  StatusOr<std::unique_ptr<Charge>> ReserveHost(Family f, uint64_t bytes);
  const ByteBudget* host_budget(Family f) const { return &opts_.host[static_cast<int>(f)]; }

  // ---- Room ----------------------------------------------------------------------------------
  // True when `bytes` fit in `tier` for family f now, after dropping clean replicas (no I/O).
  bool RoomNow(Tier tier, Family f, uint64_t bytes);
  // Demotes least recently used objects (writing spill copies where no lower copy exists) until
  // `bytes` fit in `tier` for f, then done(Ok). kOom "tier=<tier>" when nothing more can be
  // demoted, kTimeout when the deadline passes or cannot be met, kIo/kOom when the disk fails.
  void MakeRoom(Tier tier, Family f, uint64_t bytes, Deadline deadline, Done done);
  // Drops replicas in `tier` that another tier also holds, least recently used first, until
  // `need` bytes were freed (only family `only`'s when given). Returns the bytes freed. No I/O:
  // what the memory accountant's reclaimer calls.
  uint64_t ReclaimClean(Tier tier, std::optional<Family> only, uint64_t need);

  // ---- Residency -----------------------------------------------------------------------------
  // Pins every object in `tier` when all are resident there (true); otherwise pins nothing.
  bool TryPinAll(const std::vector<ObjectRef>& objs, Tier tier, PinSet* pins);
  // Brings every object into `tier` (kHost or kGpu), promoting from the fastest tier that holds
  // it, and calls done(Ok, pins) with all of them pinned there; or done(error) — kTimeout (the
  // deadline cannot be or was not met), kBusy (promotion credits), kOom "tier=..." (no room can
  // be made), kCorrupt (an object's only copy failed validation), kIo, kDevice.
  void Require(std::vector<ObjectRef> objs, Tier tier, Deadline deadline, PinnedDone done);
  // Seconds a Require of these objects into `tier` is expected to take now (0 when resident).
  double EstimateSeconds(const std::vector<ObjectRef>& objs, Tier tier) const;

  // ---- Disk copies -----------------------------------------------------------------------------
  // What a durable file holds, in order: raw bytes (one block: an index, a table), or every
  // block of an object, taken from whichever tier holds it — memory, its disk copy (read and
  // verified while the file is written, so an object larger than memory still saves), or the
  // GPU.
  struct SaveItem {
    std::string bytes;
    ObjectRef obj;
  };
  // Blocking (an I/O thread): writes a durable object file (store/disk: temp, fsync, rename,
  // directory fsync) under the disk quota and opens it. (*object_blocks)[i] receives the file
  // blocks of item i's object. kOom "tier=disk" over the quota, kIo when the disk fails,
  // kCorrupt when an object's only copy fails validation.
  StatusOr<std::shared_ptr<DiskFile>> WriteSaved(const std::string& dir, std::string_view name,
                                                 uint64_t version, std::string_view meta,
                                                 const std::vector<SaveItem>& items,
                                                 std::vector<std::vector<uint32_t>>* object_blocks);
  // The same for blocks already in memory.
  StatusOr<std::shared_ptr<DiskFile>> WriteSaved(
      const std::string& dir, std::string_view name, uint64_t version, std::string_view meta,
      const std::vector<std::span<const uint8_t>>& blocks);
  // Opens a saved file found at start-up (charged to the disk quota).
  StatusOr<std::shared_ptr<DiskFile>> OpenSaved(const std::string& path);
  // The object's content at `generation` is in `file` (blocks[i] holds block i): it gains that
  // durable disk copy (replacing a spill copy), unless it changed since (then nothing happens).
  void AttachDisk(const ObjectRef& obj, uint64_t generation, std::shared_ptr<DiskFile> file,
                  std::vector<uint32_t> blocks);

  // ---- GPU bytes outside objects (block summaries) ----------------------------------------------
  bool ReserveGpuExtra(uint64_t bytes);
  void ReleaseGpuExtra(uint64_t bytes) { gpu_.Release(bytes); }
  ByteBudget* gpu_extra_budget() { return &gpu_extra_; }

  // ---- Budgets and counters ----------------------------------------------------------------
  bool has_gpu() const { return gpu_.limit() > 0; }
  GpuBudget& gpu_budget() { return gpu_; }
  DiskQuota& disk_quota() { return disk_; }
  // --gpu-memory at run time: lowering it demotes at once.
  void SetGpuLimit(uint64_t bytes);
  void CountRefusal(Stage stage, Refusal why) {
    refusals_[static_cast<int>(stage)][static_cast<int>(why)].fetch_add(1,
                                                                        std::memory_order_relaxed);
  }

  struct TierStats {
    uint64_t objects = 0, bytes = 0;  // replicas linked in the tier
  };
  struct Stats {
    std::array<TierStats, kTierCount> tiers;
    // [from][to]: promotions go up (disk->host, host->gpu), demotions down (gpu->host,
    // host->disk); "drops" are replicas released because another tier held the bytes.
    uint64_t promotions[kTierCount][kTierCount] = {};
    uint64_t promotion_bytes[kTierCount][kTierCount] = {};
    uint64_t demotions[kTierCount][kTierCount] = {};
    uint64_t demotion_bytes[kTierCount][kTierCount] = {};
    uint64_t drops[kTierCount] = {};
    uint64_t backend_reads = 0;  // disk blocks read by promotions
    uint64_t coalesced = 0;      // requests that joined a transfer already in flight
    uint64_t room_waits = 0;     // MakeRoom calls that waited for demotions
    uint64_t corrupt_replicas = 0, lost_objects = 0;
    uint64_t spill_files = 0;
    uint64_t inflight_promotion_bytes = 0, promotion_credits = 0;
    uint64_t refusals[kStageCount][kRefusalCount] = {};
    double rate[4] = {};  // measured bytes/s: disk read, disk write, GPU upload, GPU download
    bool rate_measured[4] = {};  // false: no transfer on the path yet (rate is a guess)
  };
  Stats stats() const;

 private:
  friend class Object;
  struct Join;
  struct RoomRequest;
  struct List {
    Object* head = nullptr;
    Object* tail = nullptr;
    uint64_t count = 0, bytes = 0;
  };
  enum Path { kDiskReadPath = 0, kDiskWritePath, kUploadPath, kDownloadPath };

  // Tier lists (under dir_mu_).
  void LinkLocked(Object* o, Tier t);
  void UnlinkLocked(Object* o, Tier t);
  // Moves o to the place its last use `used` gives it in the list (lazy LRU: a read only
  // stores the time; the order is corrected when demotion looks at the object).
  void ReorderLocked(Object* o, Tier t, int64_t used);
  void Forget(Object* o);  // ~Object
  uint64_t NextId() { return next_id_.fetch_add(1, std::memory_order_relaxed); }

  // Room.
  uint64_t Headroom(Tier tier, Family f) const;
  void RoomStep(const std::shared_ptr<RoomRequest>& r);
  void FinishRoom(const std::shared_ptr<RoomRequest>& r, const Status& s);
  void WakeRoomWaiters(Tier tier);
  struct Victim {
    ObjectRef obj;
    uint64_t generation;
    std::shared_ptr<HostReplica> host;  // host -> disk
    std::shared_ptr<GpuReplica> gpu;    // GPU -> host
  };
  // Picks dirty victims in `tier` (no lower copy) worth `need` bytes, marking them moving;
  // clean ones met on the way are dropped at once (counted in *freed).
  std::vector<Victim> PickVictims(Tier tier, std::optional<Family> only, uint64_t need,
                                  uint64_t* freed, bool dirty);
  void Spill(std::vector<Victim> victims, std::shared_ptr<RoomRequest> r);
  void SpillSegment(std::shared_ptr<std::vector<Victim>> seg, std::shared_ptr<RoomRequest> r,
                    std::shared_ptr<std::atomic<size_t>> left);
  void DownloadVictims(std::vector<Victim> victims, std::shared_ptr<RoomRequest> r);
  void Unmark(const std::vector<Victim>& victims);
  // The dirty victims of one PickVictims were handed to their jobs (or given back).
  void EndPick(Tier tier);

  // Promotion.
  void RequireImpl(std::vector<ObjectRef> objs, Tier tier, Deadline deadline, PinnedDone done,
                   bool admission);
  void JoinTransfer(const ObjectRef& obj, Tier tier, const std::shared_ptr<Join>& join);
  void StartTransfer(const std::shared_ptr<Transfer>& t);
  void DiskToHost(const std::shared_ptr<Transfer>& t, bool room_made);
  void HostToGpu(const std::shared_ptr<Transfer>& t, PinSet host_pins, bool room_made);
  void GpuToHost(const std::shared_ptr<Transfer>& t, bool room_made);
  void CompleteHost(const std::shared_ptr<Transfer>& t, std::shared_ptr<HostReplica> r, Tier from);
  void CompleteGpu(const std::shared_ptr<Transfer>& t, std::shared_ptr<GpuReplica> r);
  void FailTransfer(const std::shared_ptr<Transfer>& t, const Status& s);
  void Refuse(Stage stage, Refusal why) { CountRefusal(stage, why); }
  // A device-to-host copy of the GPU replica into new host blocks (blocking).
  StatusOr<std::shared_ptr<HostReplica>> Download(Object* o, const GpuReplica& g,
                                                  std::unique_ptr<Charge> charge);
  // An upload of host blocks into a new GPU replica (blocking); the bytes are reserved.
  StatusOr<std::shared_ptr<GpuReplica>> Upload(const Object& o, const std::vector<BufferRef>& src);

  EngineOptions opts_;
  GpuBudget gpu_;
  DiskQuota disk_;
  ByteBudget gpu_extra_;
  TimerQueue timers_;
  BandwidthMeter meters_[4];

  mutable std::mutex dir_mu_;
  List lists_[kTierCount];
  std::vector<std::shared_ptr<RoomRequest>> room_waiters_[kTierCount];  // under dir_mu_
  uint32_t demotions_in_flight_[kTierCount] = {};                       // under dir_mu_

  std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> spill_seq_{1};
  std::atomic<uint64_t> inflight_bytes_{0};
  std::atomic<uint64_t> promotions_[kTierCount][kTierCount] = {};
  std::atomic<uint64_t> promotion_bytes_[kTierCount][kTierCount] = {};
  std::atomic<uint64_t> demotions_[kTierCount][kTierCount] = {};
  std::atomic<uint64_t> demotion_bytes_[kTierCount][kTierCount] = {};
  std::atomic<uint64_t> drops_[kTierCount] = {};
  std::atomic<uint64_t> backend_reads_{0}, coalesced_{0}, room_waits_{0};
  std::atomic<uint64_t> corrupt_{0}, lost_{0}, spill_files_{0};
  std::atomic<uint64_t> refusals_[kStageCount][kRefusalCount] = {};
};

// Bytes as "12.0 MiB" for error messages (common/bytes HumanBytes).
std::string Human(uint64_t bytes);

}  // namespace pion::residency
