// The tiers an object's bytes can live in, the families that own objects, and the stages that
// can refuse a request — the vocabulary of the residency engine (engine.h), its INFO section
// and its metrics labels.
#pragma once

#include <chrono>
#include <cstdint>
#include <string_view>

namespace pion::residency {

// Fastest first. A kernel reads only the GPU tier; the host tier is what the server's CPU code
// and replies read; the disk tier holds spill copies (demotions, never outliving the process)
// and saved copies (durable: they come back after a restart).
enum class Tier : uint8_t { kGpu = 0, kHost = 1, kDisk = 2 };
inline constexpr int kTierCount = 3;
std::string_view TierName(Tier t);  // "gpu", "host", "disk"

// Whose object: host bytes are charged to the family's memory counter (INFO memory), and the
// engine's counters are kept per family.
enum class Family : uint8_t { kState = 0, kSsm, kVStore, kAttention, kCount };
inline constexpr int kFamilyCount = static_cast<int>(Family::kCount);
std::string_view FamilyName(Family f);  // "state", "ssm", "vstore", "attention"

// The step of a request that refused it (seed 004 §0x08K: metrics name the failed stage).
enum class Stage : uint8_t {
  kHostRoom = 0,    // making room in host memory (--maxmemory, a family cap)
  kGpuRoom,         // making room on the GPU (--gpu-memory)
  kDiskRoom,        // the disk quota (--disk-quota) or a full disk
  kDiskRead,        // promotion disk -> host
  kDiskWrite,       // demotion host -> disk, or a save
  kGpuUpload,       // promotion host -> GPU
  kGpuDownload,     // demotion GPU -> host
  kPromotionQueue,  // promotion credits (--promotion-credits)
  kCompute,         // the compute queue, for a request with a deadline
  kCount
};
inline constexpr int kStageCount = static_cast<int>(Stage::kCount);
std::string_view StageName(Stage s);  // "host_room", "gpu_room", ...

// Why it refused.
enum class Refusal : uint8_t { kDeadline = 0, kCredits, kOom, kIo, kCorrupt, kCount };
inline constexpr int kRefusalCount = static_cast<int>(Refusal::kCount);
std::string_view RefusalName(Refusal r);  // "deadline", "credits", "oom", "io", "corrupt"

using Clock = std::chrono::steady_clock;
// When a request must be answered by; kNoDeadline: whenever it is done.
using Deadline = Clock::time_point;
inline constexpr Deadline kNoDeadline = Deadline::max();

}  // namespace pion::residency
