// gpu.h for a build without CUDA: no device, so --attention-backend cuda is refused at startup
// with this reason and auto picks the CPU.
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/gpu.h"

namespace pion::gpu {

Status NoCuda() {
  return Status(ErrorKind::kDevice, "this pion-server was built without CUDA (PION_CUDA=OFF)");
}

const DeviceInfo& Info() {
  static const DeviceInfo info = [] {
    DeviceInfo d;
    d.reason = "built without CUDA";
    return d;
  }();
  return info;
}

StatusOr<DeviceMemory> Allocate(uint64_t) { return NoCuda(); }
DeviceMemory::~DeviceMemory() = default;
DeviceMemory& DeviceMemory::operator=(DeviceMemory&& o) noexcept { return *this; }
PoolStats Pool() { return {}; }

Event::Event() = default;
Event::~Event() = default;
Status Event::WaitOn(void*) const { return NoCuda(); }
Status Event::Synchronize() const { return NoCuda(); }

StatusOr<Context*> Context::ForThisThread() { return NoCuda(); }
Context::~Context() = default;
void Context::Reset() {}
void Context::Free(Arena&, bool) {}
StatusOr<void*> Context::Take(Arena&, size_t, bool) { return NoCuda(); }
StatusOr<void*> Context::Host(size_t) { return NoCuda(); }
StatusOr<void*> Context::Device(size_t) { return NoCuda(); }
StatusOr<Context::Staged> Context::Stage(size_t) { return NoCuda(); }
Status Context::FlushStaged() { return NoCuda(); }
StatusOr<uint32_t*> Context::Counters(size_t) { return NoCuda(); }
Status Context::ToDevice(void*, const void*, size_t) { return NoCuda(); }
Status Context::ToHost(void*, const void*, size_t) { return NoCuda(); }
Status Context::Memset(void*, int, size_t) { return NoCuda(); }
Status Context::Sync() { return NoCuda(); }
Status Context::CheckLaunch(const char*) { return NoCuda(); }

BufferAllocator* PinnedHostAllocator() { return BufferAllocator::Default(); }
bool IsPinned(const void*, size_t) { return false; }
Status Upload(DeviceMemory&, const std::vector<HostSpan>&, Event*) { return NoCuda(); }
StatusOr<std::string> IpcHandle(const void*) { return NoCuda(); }
Status Download(void*, const void*, size_t) { return NoCuda(); }
Status CudaError(int, const char*) { return NoCuda(); }

}  // namespace pion::gpu

namespace pion::kernels::cuda {

using gpu::NoCuda;

bool UsesTensorCores(const AttendArgs&) { return false; }
bool StreamDecodeFits(const AttendArgs&) { return false; }
uint32_t StreamDecodeTile(const AttendArgs&) { return 0; }
void SetStreamDecodeTile(uint32_t) {}
void SetStreamDecodeBlocks(uint32_t) {}
void SetStreamDecodeTeams(uint32_t) {}
uint32_t StreamDecodeTeams(const AttendArgs&, uint64_t) { return 1; }
void SetOverlapCalls(bool) {}
bool OverlapCalls() { return false; }
int FlashRowGroups(const AttendArgs&) { return 1; }
void SetLowpBatched(bool) {}
bool LowpBatched() { return false; }
uint32_t PlanSplits(const AttendArgs&, uint64_t) { return 1; }
uint32_t GridBlocks(const AttendArgs& a) { return a.n_items; }
Status LaunchAttend(const AttendArgs&, void*) { return NoCuda(); }
Status LaunchCombine(uint32_t, uint32_t, uint32_t, const float*, const float*, const float*, float*,
                     float*, void*) {
  return NoCuda();
}
Status LaunchScores(const AttendArgs&, const int32_t*, uint32_t, uint32_t, float*, void*) {
  return NoCuda();
}
Status LaunchSelectRows(const AttendArgs&, uint32_t, uint32_t, const float*, uint32_t, int32_t*,
                        int32_t*, float*, uint8_t*, void*) {
  return NoCuda();
}
Status LaunchSummarize(const void*, DType, const float*, uint32_t, uint32_t, uint32_t, uint32_t,
                       uint32_t, float*, float*, float*, void*) {
  return NoCuda();
}
Status LaunchScoreBlocks(const float*, uint32_t, uint32_t, const int32_t*, const float*,
                         const float*, const float*, uint32_t, BlockSelector, float*, float*, void*,
                         uint32_t, uint32_t) {
  return NoCuda();
}
Status LaunchSelectBlocks(const float*, const float*, const int32_t*, uint32_t, bool, uint32_t,
                          uint32_t, uint32_t, uint32_t, uint32_t, float, int32_t*, int32_t*,
                          int32_t*, int32_t*, uint32_t, float*, void*) {
  return NoCuda();
}
Status LaunchSparseAutoShared(const FusedSparseArgs&, void*) { return NoCuda(); }
bool SparseAutoSharedFits(DType, uint32_t, uint32_t, uint32_t, uint32_t) { return false; }
uint32_t SparseAutoSharedCluster(uint32_t, uint32_t, uint32_t) { return 8; }
int SparseAutoSharedActiveClusters(uint32_t, uint32_t) { return 0; }
bool DecodeClusterFits(DType, uint32_t, uint32_t, uint32_t, uint64_t) { return false; }
uint64_t DecodeClusterMaxKeys(DType) { return 0; }
Status LaunchDecodeCluster(const DecodeClusterArgs&, void*) { return NoCuda(); }

}  // namespace pion::kernels::cuda
