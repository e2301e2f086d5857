// gpu.h on the CUDA runtime (linked statically: a host without a driver gets a clear "no
// device" from Info(), not a loader error).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "kernels/cuda/gpu.h"

namespace pion::gpu {

Status CudaError(int code, const char* what) {
  auto e = static_cast<cudaError_t>(code);
  return Status(ErrorKind::kDevice, std::string("cuda error ") + cudaGetErrorName(e) + ": " +
                                        cudaGetErrorString(e) + " (" + what + ")");
}

#define PION_CUDA_TRY(expr, what)                        \
  do {                                                   \
    cudaError_t e_ = (expr);                             \
    if (e_ != cudaSuccess) return CudaError(e_, (what)); \
  } while (0)

const DeviceInfo& Info() {
  static const DeviceInfo info = [] {
    DeviceInfo d;
    d.built = true;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      d.reason = e != cudaSuccess ? std::string(cudaGetErrorString(e)) : "no CUDA device";
      cudaGetLastError();  // clear the sticky-free error
      return d;
    }
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) {
      d.reason = "cudaGetDeviceProperties failed";
      return d;
    }
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
      d.reason = "cudaMemGetInfo failed";
      return d;
    }
    d.present = true;
    d.name = p.name;
    char bus[32] = {0};
    if (cudaDeviceGetPCIBusId(bus, sizeof(bus), 0) == cudaSuccess) d.pci_bus_id = bus;
    d.cc_major = p.major;
    d.cc_minor = p.minor;
    d.sms = p.multiProcessorCount;
    d.smem_block_optin = p.sharedMemPerBlockOptin;
    d.total_bytes = total_b;
    d.free_bytes = free_b;
    return d;
  }();
  return info;
}

// ---- The pool ------------------------------------------------------------------------------

namespace {

uint64_t SizeClass(uint64_t bytes) {
  constexpr uint64_t kLarge = 2ull << 20;
  if (bytes >= kLarge) return (bytes + kLarge - 1) / kLarge * kLarge;
  uint64_t c = 4096;
  while (c < bytes) c <<= 1;
  return c;
}

struct PoolState {
  std::mutex mu;
  std::map<uint64_t, std::vector<void*>> cache;  // size class → free blocks
  PoolStats stats;
  std::atomic<uint64_t> next_id{1};

  void ReleaseCache() {
    for (auto& [size, blocks] : cache) {
      for (void* p : blocks) cudaFree(p);
      stats.cached_bytes -= size * blocks.size();
    }
    cache.clear();
  }
};

PoolState& ThePool() {
  static PoolState* pool = new PoolState();  // never destroyed: blocks may be freed during exit
  return *pool;
}

}  // namespace

StatusOr<DeviceMemory> Allocate(uint64_t bytes) {
  if (!Info().present) return Status(ErrorKind::kOom, "no CUDA device: " + Info().reason);
  const uint64_t cls = SizeClass(std::max<uint64_t>(bytes, 1));
  PoolState& pool = ThePool();
  std::lock_guard lock(pool.mu);
  void* p = nullptr;
  auto it = pool.cache.find(cls);
  if (it != pool.cache.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    pool.stats.cached_bytes -= cls;
  } else {
    cudaError_t e = cudaMalloc(&p, cls);
    if (e != cudaSuccess) {
      cudaGetLastError();
      pool.ReleaseCache();
      e = cudaMalloc(&p, cls);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      return Status(ErrorKind::kOom, "GPU memory exhausted: cudaMalloc(" + std::to_string(cls) +
                                         ") failed: " + cudaGetErrorString(e));
    }
    ++pool.stats.device_mallocs;
  }
  pool.stats.in_use_bytes += cls;
  ++pool.stats.allocations;
  DeviceMemory m;
  m.ptr_ = p;
  m.bytes_ = bytes;
  m.capacity_ = cls;
  m.id_ = pool.next_id.fetch_add(1, std::memory_order_relaxed);
  return m;
}

DeviceMemory::~DeviceMemory() {
  if (ptr_ == nullptr) return;
  PoolState& pool = ThePool();
  std::lock_guard lock(pool.mu);
  pool.cache[capacity_].push_back(ptr_);
  pool.stats.in_use_bytes -= capacity_;
  pool.stats.cached_bytes += capacity_;
}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& o) noexcept {
  if (this != &o) {
    this->~DeviceMemory();
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    capacity_ = std::exchange(o.capacity_, 0);
    id_ = std::exchange(o.id_, 0);
  }
  return *this;
}

PoolStats Pool() {
  auto& pool = ThePool();
  std::lock_guard lock(pool.mu);
  return pool.stats;
}

// ---- Events --------------------------------------------------------------------------------

Event::Event() {
  cudaEvent_t e = nullptr;
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess) ev_ = e;
}
Event::~Event() {
  if (ev_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(ev_));
}
Status Event::WaitOn(void* stream) const {
  PION_CUDA_TRY(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(ev_), 0),
      "cudaStreamWaitEvent");
  return Status::Ok();
}
Status Event::Synchronize() const {
  PION_CUDA_TRY(cudaEventSynchronize(static_cast<cudaEvent_t>(ev_)), "cudaEventSynchronize");
  return Status::Ok();
}

// ---- Per-thread contexts -------------------------------------------------------------------

StatusOr<Context*> Context::ForThisThread() {
  thread_local std::unique_ptr<Context> ctx;
  if (ctx) return ctx.get();
  if (!Info().present) return Status(ErrorKind::kDevice, "no CUDA device: " + Info().reason);
  std::unique_ptr<Context> c(new Context());
  cudaStream_t s = nullptr;
  PION_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  c->stream_ = s;
  ctx = std::move(c);
  return ctx.get();
}

Context::~Context() {
  if (stream_ != nullptr) {
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
    cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  }
  Free(host_, true);
  Free(dev_, false);
  Free(up_host_, true);
  Free(up_dev_, false);
  if (counters_ != nullptr) cudaFree(counters_);
}

StatusOr<uint32_t*> Context::Counters(size_t n) {
  if (n > counters_n_) {
    const size_t want = std::max<size_t>(n, 4096);
    PION_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "counters");
    if (counters_ != nullptr) cudaFree(counters_);
    counters_ = nullptr;
    counters_n_ = 0;
    void* p = nullptr;
    PION_CUDA_TRY(cudaMalloc(&p, want * sizeof(uint32_t)), "counters");
    PION_CUDA_TRY(cudaMemset(p, 0, want * sizeof(uint32_t)), "counters");
    counters_ = static_cast<uint32_t*>(p);
    counters_n_ = want;
  }
  return counters_;
}

void Context::Free(Arena& a, bool pinned) {
  a.retired.push_back(a.base);
  for (void* p : a.retired) {
    if (p != nullptr) pinned ? cudaFreeHost(p) : cudaFree(p);
  }
  a = Arena{};
}

void Context::Reset() {
  // The previous job synchronized its stream: outgrown blocks are free to go.
  for (Arena* a : {&host_, &dev_, &up_host_, &up_dev_}) {
    const bool pinned = a == &host_ || a == &up_host_;
    for (void* p : a->retired) pinned ? cudaFreeHost(p) : cudaFree(p);
    a->retired.clear();
    a->used = 0;
  }
  up_flushed_ = 0;
}

StatusOr<Context::Staged> Context::Stage(size_t n) {
  n = (n + 255) & ~size_t{255};
  if (up_host_.used + n > up_host_.cap) {
    // Growing moves to new blocks: send what is staged in the old ones first.
    Status s = FlushStaged();
    if (!s.ok()) return s;
  }
  auto h = Take(up_host_, n, true);
  if (!h.ok()) return h.status();
  if (up_dev_.cap != up_host_.cap) {  // the host twin grew: grow the device twin alike
    if (up_dev_.base != nullptr) up_dev_.retired.push_back(up_dev_.base);
    up_dev_.base = nullptr;
    up_dev_.used = 0;
    up_dev_.cap = 0;
    cudaError_t e = cudaMalloc(&up_dev_.base, up_host_.cap);
    if (e != cudaSuccess) {
      cudaGetLastError();
      up_dev_.base = nullptr;
      return Status(ErrorKind::kOom, std::string("GPU upload staging: ") + cudaGetErrorString(e));
    }
    up_dev_.cap = up_host_.cap;
    up_flushed_ = up_host_.used - n;  // the new block starts here
  }
  const size_t off = up_host_.used - n;
  up_dev_.used = up_host_.used;
  return Staged{h.value(), static_cast<uint8_t*>(up_dev_.base) + off};
}

Status Context::FlushStaged() {
  if (up_host_.used <= up_flushed_) return Status::Ok();
  const size_t off = up_flushed_, n = up_host_.used - up_flushed_;
  up_flushed_ = up_host_.used;
  PION_CUDA_TRY(cudaMemcpyAsync(static_cast<uint8_t*>(up_dev_.base) + off,
                                static_cast<uint8_t*>(up_host_.base) + off, n,
                                cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream_)),
                "staged upload");
  return Status::Ok();
}

StatusOr<void*> Context::Take(Arena& a, size_t n, bool pinned) {
  n = (n + 255) & ~size_t{255};
  if (a.used + n > a.cap) {
    // A new, larger block; the current one stays valid (earlier pointers of this job) until
    // the next Reset.
    if (a.base != nullptr) a.retired.push_back(a.base);
    a.base = nullptr;
    const size_t cap = std::max<size_t>({n, 2 * a.cap, size_t{1} << 20});
    cudaError_t e = pinned ? cudaMallocHost(&a.base, cap) : cudaMalloc(&a.base, cap);
    if (e != cudaSuccess) {
      cudaGetLastError();
      a.base = nullptr;
      a.cap = a.used = 0;
      return Status(ErrorKind::kOom, std::string("GPU scratch of ") + std::to_string(cap) +
                                         " bytes: " + cudaGetErrorString(e));
    }
    a.cap = cap;
    a.used = 0;
  }
  void* p = static_cast<uint8_t*>(a.base) + a.used;
  a.used += n;
  return p;
}

StatusOr<void*> Context::Host(size_t n) { return Take(host_, n, true); }
StatusOr<void*> Context::Device(size_t n) { return Take(dev_, n, false); }

Status Context::ToDevice(void* dst, const void* src, size_t n) {
  if (n == 0) return Status::Ok();
  PION_CUDA_TRY(
      cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream_)),
      "copy to device");
  return Status::Ok();
}
Status Context::ToHost(void* dst, const void* src, size_t n) {
  if (n == 0) return Status::Ok();
  PION_CUDA_TRY(
      cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream_)),
      "copy to host");
  return Status::Ok();
}
Status Context::Memset(void* dst, int value, size_t n) {
  if (n == 0) return Status::Ok();
  PION_CUDA_TRY(cudaMemsetAsync(dst, value, n, static_cast<cudaStream_t>(stream_)), "memset");
  return Status::Ok();
}
Status Context::Sync() {
  PION_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "stream sync");
  return Status::Ok();
}
Status Context::CheckLaunch(const char* what) {
  PION_CUDA_TRY(cudaGetLastError(), what);
  return Status::Ok();
}

// ---- Uploads -------------------------------------------------------------------------------

namespace {

// A copy stream with two pinned staging buffers, one per thread that uploads.
struct Stager {
  static constexpr size_t kChunk = 8 << 20;
  cudaStream_t stream = nullptr;
  void* buf[2] = {nullptr, nullptr};
  cudaEvent_t used[2] = {nullptr, nullptr};
  bool ok = false;

  Stager() {
    ok = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess;
    for (int i = 0; ok && i < 2; ++i) {
      ok = cudaMallocHost(&buf[i], kChunk) == cudaSuccess &&
           cudaEventCreateWithFlags(&used[i], cudaEventDisableTiming) == cudaSuccess;
    }
    if (!ok) cudaGetLastError();
  }
  ~Stager() {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    for (int i = 0; i < 2; ++i) {
      if (buf[i] != nullptr) cudaFreeHost(buf[i]);
      if (used[i] != nullptr) cudaEventDestroy(used[i]);
    }
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

}  // namespace

Status Upload(DeviceMemory& dst, const std::vector<HostSpan>& src, Event* done) {
  if (!Info().present) return Status(ErrorKind::kDevice, "no CUDA device: " + Info().reason);
  std::vector<uint64_t> sizes;
  for (const HostSpan& h : src) sizes.push_back(h.size);
  uint64_t bytes = 0;
  const std::vector<uint64_t> offsets = SpanOffsets(sizes, &bytes);
  if (bytes > dst.size()) return Status(ErrorKind::kDevice, "upload larger than its block");
  thread_local std::unique_ptr<Stager> stager;
  if (!stager) stager = std::make_unique<Stager>();
  if (!stager->ok) return Status(ErrorKind::kOom, "cannot create pinned upload staging");
  const uint64_t fence = dst.id();
  int i = 0;
  for (size_t span = 0; span < src.size(); ++span) {
    const HostSpan& h = src[span];
    uint8_t* to = static_cast<uint8_t*>(dst.data()) + offsets[span];
    const uint8_t* from = static_cast<const uint8_t*>(h.data);
    if (IsPinned(from, h.size)) {  // one DMA from where the bytes are
      PION_CUDA_TRY(cudaMemcpyAsync(to, from, h.size, cudaMemcpyHostToDevice, stager->stream),
                    "upload");
      continue;
    }
    for (uint64_t off = 0; off < h.size; off += Stager::kChunk, i ^= 1) {
      const uint64_t n = std::min<uint64_t>(Stager::kChunk, h.size - off);
      // The staging buffer is reused only after its previous copy completed.
      PION_CUDA_TRY(cudaEventSynchronize(stager->used[i]), "staging reuse");
      std::memcpy(stager->buf[i], from + off, n);
      PION_CUDA_TRY(
          cudaMemcpyAsync(to + off, stager->buf[i], n, cudaMemcpyHostToDevice, stager->stream),
          "upload");
      PION_CUDA_TRY(cudaEventRecord(stager->used[i], stager->stream), "upload event");
    }
  }
  if (done != nullptr) {
    PION_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(done->raw()), stager->stream),
                  "upload done event");
  }
  PION_CUDA_TRY(cudaStreamSynchronize(stager->stream), "upload completion");
  if (dst.id() != fence) return Status(ErrorKind::kDevice, "upload target was reallocated");
  return Status::Ok();
}

StatusOr<std::string> IpcHandle(const void* base) {
  cudaIpcMemHandle_t h;
  PION_CUDA_TRY(cudaIpcGetMemHandle(&h, const_cast<void*>(base)), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

Status Download(void* dst, const void* src, size_t n) {
  PION_CUDA_TRY(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "download");
  return Status::Ok();
}

}  // namespace pion::gpu
