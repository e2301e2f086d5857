#include "residency/tier.h"

namespace pion::residency {

std::string_view TierName(Tier t) {
  switch (t) {
    case Tier::kGpu:
      return "gpu";
    case Tier::kHost:
      return "host";
    case Tier::kDisk:
      return "disk";
  }
  return "?";
}

std::string_view FamilyName(Family f) {
  switch (f) {
    case Family::kState:
      return "state";
    case Family::kSsm:
      return "ssm";
    case Family::kVStore:
      return "vstore";
    case Family::kAttention:
      return "attention";
    case Family::kCount:
      break;
  }
  return "?";
}

std::string_view StageName(Stage s) {
  switch (s) {
    case Stage::kHostRoom:
      return "host_room";
    case Stage::kGpuRoom:
      return "gpu_room";
    case Stage::kDiskRoom:
      return "disk_room";
    case Stage::kDiskRead:
      return "disk_read";
    case Stage::kDiskWrite:
      return "disk_write";
    case Stage::kGpuUpload:
      return "gpu_upload";
    case Stage::kGpuDownload:
      return "gpu_download";
    case Stage::kPromotionQueue:
      return "promotion_queue";
    case Stage::kCompute:
      return "compute";
    case Stage::kCount:
      break;
  }
  return "?";
}

std::string_view RefusalName(Refusal r) {
  switch (r) {
    case Refusal::kDeadline:
      return "deadline";
    case Refusal::kCredits:
      return "credits";
    case Refusal::kOom:
      return "oom";
    case Refusal::kIo:
      return "io";
    case Refusal::kCorrupt:
      return "corrupt";
    case Refusal::kCount:
      break;
  }
  return "?";
}

}  // namespace pion::residency
