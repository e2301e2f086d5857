// The CUDA runtime as Pion uses it, behind a header with no CUDA types: device probing, a
// cudaMalloc-backed memory pool, per-thread streams with pinned and device scratch, events, and
// uploads through pinned staging. A build without CUDA (or a host without a GPU) gets the same
// interface with Info().present == false and every allocation refused, so callers need no #ifdefs.
//
// Residency rules (seed 004 §0x02A, §0x03D–0x03F): an upload returns only after the copy's
// event completed and the copy was checked, so nothing is published from an unfinished
// transfer; every allocation carries a unique id so a completion can be matched against the
// allocation it was issued for (a freed and reused block has a new id: no ABA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/status.h"

namespace pion::gpu {

struct DeviceInfo {
  bool built = false;    // compiled with CUDA
  bool present = false;  // a usable device was found
  std::string reason;    // why not, when !present
  std::string name;
  std::string pci_bus_id;  // e.g. "0000:1B:00.0": which GPU an IPC handle belongs to
  int cc_major = 0, cc_minor = 0, sms = 0;
  uint64_t smem_block_optin = 0;  // shared memory a block may opt in to (bytes)
  uint64_t total_bytes = 0, free_bytes = 0;
};
// Probes device 0 once (thread-safe).
const DeviceInfo& Info();

// One block of device memory from the pool; returns to the pool when destroyed.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  ~DeviceMemory();
  DeviceMemory(DeviceMemory&& o) noexcept { *this = std::move(o); }
  DeviceMemory& operator=(DeviceMemory&& o) noexcept;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  void* data() const { return ptr_; }
  uint64_t size() const { return bytes_; }
  uint64_t id() const { return id_; }  // unique per allocation, never reused
  explicit operator bool() const { return ptr_ != nullptr; }

 private:
  friend StatusOr<DeviceMemory> Allocate(uint64_t bytes);
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;     // requested
  uint64_t capacity_ = 0;  // the pool block's size class
  uint64_t id_ = 0;
};

// Plain cudaMalloc memory (never managed), rounded up to a size class and cached on free; kOom
// when the device has no room even after the cache was released.
StatusOr<DeviceMemory> Allocate(uint64_t bytes);

struct PoolStats {
  uint64_t in_use_bytes = 0;  // handed out
  uint64_t cached_bytes = 0;  // freed, kept for reuse
  uint64_t allocations = 0;   // Allocate calls that succeeded
  uint64_t device_mallocs = 0;
};
PoolStats Pool();

// A completion marker recorded on a stream (cudaEvent, timing disabled).
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  // Makes work later submitted to `stream` wait for this event (no host wait).
  Status WaitOn(void* stream) const;
  Status Synchronize() const;
  void* raw() const { return ev_; }

 private:
  void* ev_ = nullptr;
};

// The calling thread's execution context: its own non-blocking stream, a pinned host scratch
// and a device scratch, both growing bump arenas reset per job.
class Context {
 public:
  static StatusOr<Context*> ForThisThread();
  ~Context();

  void* stream() const { return stream_; }
  // Starts a job: both arenas are empty again.
  void Reset();
  // n bytes (256-aligned) of pinned host / device scratch valid until the next Reset (an arena
  // that runs out starts a larger block; earlier blocks live until the Reset).
  StatusOr<void*> Host(size_t n);
  StatusOr<void*> Device(size_t n);
  // Upload staging: n bytes (256-aligned) of pinned memory to fill now, and the device address
  // they will have after the next FlushStaged() — which copies everything staged since the last
  // flush in one transfer.
  struct Staged {
    void* host;
    void* device;
  };
  StatusOr<Staged> Stage(size_t n);
  Status FlushStaged();
  // n zeroed uint32 counters on the device that kernels leave zeroed again (split-K finish);
  // persistent across jobs, grown on demand.
  StatusOr<uint32_t*> Counters(size_t n);
  Status ToDevice(void* dst, const void* src, size_t n);  // async on stream()
  Status ToHost(void* dst, const void* src, size_t n);    // async on stream()
  Status Memset(void* dst, int value, size_t n);          // async on stream()
  // Waits for everything submitted to stream(); reports a kernel or copy failure.
  Status Sync();
  // The last launch error (after a kernel launch).
  Status CheckLaunch(const char* what);

 private:
  Context() = default;
  struct Arena {
    void* base = nullptr;
    size_t cap = 0, used = 0;
    std::vector<void*> retired;  // outgrown blocks of the current job
  };
  void Free(Arena& a, bool pinned);
  StatusOr<void*> Take(Arena& a, size_t n, bool pinned);
  void* stream_ = nullptr;
  Arena host_, dev_;
  Arena up_host_, up_dev_;  // upload twins: same offsets, same capacity
  size_t up_flushed_ = 0;
  uint32_t* counters_ = nullptr;
  size_t counters_n_ = 0;
};

// Host memory the GPU copies by DMA at link speed (page-locked, registered with the driver):
// where the host replicas of GPU-resident objects live, so that a promotion host -> GPU is one
// transfer straight from them and a demotion GPU -> host lands in them directly. Freed regions
// are kept for reuse (registering pins every page). Without a device: BufferAllocator::Default().
BufferAllocator* PinnedHostAllocator();
// Whether [p, p + n) lies in one page-locked region of PinnedHostAllocator().
bool IsPinned(const void* p, size_t n);

// Host bytes to upload, in order.
struct HostSpan {
  const void* data;
  uint64_t size;
};

// Where Upload places the spans of one allocation: each starts at a multiple of kSpanAlign
// bytes (an fp8 block's size, elements then row scales, is not a multiple of 16: packed back to
// back, the next block's rows would be misaligned for vector and tensor-copy loads).
constexpr uint64_t kSpanAlign = 256;
inline uint64_t AlignSpan(uint64_t off) { return (off + kSpanAlign - 1) / kSpanAlign * kSpanAlign; }
// The offsets Upload gives spans of these sizes, and the bytes it needs in all.
inline std::vector<uint64_t> SpanOffsets(const std::vector<uint64_t>& sizes, uint64_t* total) {
  std::vector<uint64_t> out;
  uint64_t off = 0;
  for (uint64_t s : sizes) {
    off = AlignSpan(off);
    out.push_back(off);
    off += s;
  }
  if (total != nullptr) *total = off;
  return out;
}

// Copies the spans into `dst`, each at its SpanOffsets offset, on a dedicated copy stream: spans in
// page-locked memory (IsPinned) go straight from where they are, others through two pinned staging
// buffers (a memcpy each). Returns once the copy completed and the allocation's id fence still
// matched; `done` (if given) is recorded after the last copy.
Status Upload(DeviceMemory& dst, const std::vector<HostSpan>& src, Event* done);

// A CUDA IPC handle (cudaIpcMemHandle_t, 64 bytes) for the device allocation that starts at
// `base` (a DeviceMemory's data()): another process on the same GPU opens it with
// cudaIpcOpenMemHandle / cuIpcOpenMemHandle and reads the memory device to device.
StatusOr<std::string> IpcHandle(const void* base);

// Device → host copy of n bytes (blocking), for tests and diagnostics.
Status Download(void* dst, const void* src, size_t n);

// "cuda error <name>: <text> (<what>)".
Status CudaError(int code, const char* what);

}  // namespace pion::gpu
