// pion-gpu-decode-patterns: how the M = 1 decode's K/V read streams on this GPU, without the
// attention math — the read patterns a decode kernel can use, each over the split-K partition
// of [heads][N] rows of K and of V (splits per head = blockIdx.x, head = blockIdx.y), next to
// the plain streaming read of the same bytes. A per-16-row spin (`delay` cycles) stands in for
// the math a tile costs. Timed as the attention bench times: mean per call over replays of a
// CUDA graph of 20 calls.
//
//   pion-gpu-decode-patterns <row_bytes> <N> [heads=8]
//
// Patterns (one line each): warp rings of 16-row tiles by cp.async (the current decode's
// pieces) or by one bulk copy each; block rings of T-row tiles by one bulk copy each (K and V),
// or by 2-D tensor copies of 128-byte columns with the 128-byte swizzle (64-byte rows, fp8
// d = 64: 64-byte columns, 64-byte swizzle); plain loads into registers. Prints one JSON object
// per line. (64-byte rows at N read the bytes of 128-byte rows at N / 2: running both compares
// the 64-byte tensor copies with the 128-byte ones over the same bytes.)
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu_stream.h"
#include "kernels/cuda/cuda_common.cuh"

namespace {

// Pion's bulk and tensor copies and mbarriers (cuda_common.cuh), EncodeTensorMap.
using namespace pion::kernels::cuda;  // NOLINT

struct Args {
  const uint8_t* k;
  const uint8_t* v;
  uint32_t heads, n, row;  // rows a head, bytes a row
  uint32_t splits;
  uint32_t delay;  // spin cycles per 16 rows
  uint32_t mode;   // warp rings: 0 quarters, 1 block-interleaved, 2 head-wide
  uint32_t* sink;
  TensorMapBytes mk, mv;
};

__device__ inline void Spin(uint32_t cycles) {
  if (cycles == 0) return;
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// The rows [lo, hi) of split s of a head, whole tiles of `tile` rows.
__device__ inline void SplitRange(const Args& a, uint32_t tile, uint32_t s, uint32_t& lo,
                                  uint32_t& hi) {
  const uint32_t tiles = (a.n + tile - 1) / tile;
  lo = min(a.n, uint32_t(uint64_t(tiles) * s / a.splits) * tile);
  hi = min(a.n, uint32_t(uint64_t(tiles) * (s + 1) / a.splits) * tile);
}

// Warp rings: each warp its own ring of 3 stages of 16 rows (K and V), by cp.async 16-byte
// pieces (kBulk false) or one bulk copy each (true). Rows padded by 16 bytes (cp.async).
template <bool kBulk>
__global__ void __launch_bounds__(128) WarpRing(const __grid_constant__ Args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[4][3];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t str = kBulk ? a.row : a.row + 16, tileb = 16 * str;
  uint8_t* ring = smem + warp * 3 * 2 * tileb;
  uint32_t lo, hi, step, first;
  const uint32_t head = blockIdx.y;
  if (a.mode == 2) {
    lo = 0, hi = a.n;
    first = (blockIdx.x * 4 + warp) * 16;
    step = a.splits * 4 * 16;
  } else {
    SplitRange(a, 64, blockIdx.x, lo, hi);
    if (a.mode == 1) {
      first = lo + warp * 16, step = 64;
    } else {
      const uint32_t q = (hi - lo) / 4 / 16 * 16;
      first = lo + warp * q;
      if (warp < 3) hi = lo + (warp + 1) * q;
      step = 16;
    }
  }
  const int ntiles = first < hi ? int((hi - first + step - 1) / step) : 0;
  if (kBulk && lane == 0) {
    for (int b = 0; b < 3; ++b) MbarInit(&bars[warp][b], 1);
    FenceMbarInit();
  }
  __syncwarp();
  const uint8_t* kb = a.k + size_t(head) * a.n * a.row;
  const uint8_t* vb = a.v + size_t(head) * a.n * a.row;
  auto issue = [&](int t) {
    if (t < ntiles) {
      const uint32_t r0 = first + t * step;
      const uint32_t rows = min(16u, hi - r0);
      uint8_t* ks = ring + (t % 3) * 2 * tileb;
      uint8_t* vs = ks + tileb;
      if (kBulk) {
        if (lane == 0) {
          MbarArriveExpect(&bars[warp][t % 3], 2 * rows * a.row);
          BulkCopy(ks, kb + size_t(r0) * a.row, rows * a.row, &bars[warp][t % 3]);
          BulkCopy(vs, vb + size_t(r0) * a.row, rows * a.row, &bars[warp][t % 3]);
        }
      } else {
        const uint32_t cpr = a.row / 16;
        for (uint32_t e = lane; e < rows * cpr; e += 32) {
          const uint32_t r = e / cpr, c = (e % cpr) * 16;
          __pipeline_memcpy_async(ks + r * str + c, kb + size_t(r0 + r) * a.row + c, 16);
          __pipeline_memcpy_async(vs + r * str + c, vb + size_t(r0 + r) * a.row + c, 16);
        }
      }
    }
    if (!kBulk) __pipeline_commit();
  };
  issue(0);
  issue(1);
  uint32_t acc = 0;
  for (int t = 0; t < ntiles; ++t) {
    issue(t + 2);
    if (kBulk) {
      MbarWait(&bars[warp][t % 3], (t / 3) & 1);
    } else {
      __pipeline_wait_prior(2);
    }
    __syncwarp();
    const uint8_t* ks = ring + (t % 3) * 2 * tileb;
    acc ^= *reinterpret_cast<const uint32_t*>(ks + (lane % 16) * str + 4 * (lane / 16));
    acc ^= *reinterpret_cast<const uint32_t*>(ks + tileb + (lane % 16) * str);
    Spin(a.delay);
    __syncwarp();
  }
  if (acc == 0x9e3779b9u) a.sink[blockIdx.x] = acc;
#else
  __trap();  // sm_90 only: bulk and tensor copies
#endif
}

// Block rings: S stages of T rows of K and V; thread 0 issues (one bulk copy each, or 2-D tensor
// copies of 128-byte column boxes with the 128-byte swizzle — 64-byte rows: one 64-byte box with
// the 64-byte swizzle, as the decode reads fp8 d = 64 — kTensor), every warp waits on the
// stage's barrier, reads its quarter, spins, and the block syncs before the stage is refilled.
template <int S, bool kTensor>
__global__ void __launch_bounds__(128) BlockRing(const __grid_constant__ Args a, uint32_t T) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // The 128-byte swizzle repeats every 1024 bytes: stages start 1024-aligned (1 KB extra asked).
  uint8_t* smem = smem_raw + ((1024 - (SmemAddr(smem_raw) & 1023)) & 1023);
  __shared__ __align__(8) uint64_t bars[S];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t head = blockIdx.y, tileb = T * a.row;
  uint32_t lo, hi;
  SplitRange(a, T, blockIdx.x, lo, hi);
  const int ntiles = int((hi - lo + T - 1) / T);
  if (tid == 0) {
    for (int b = 0; b < S; ++b) MbarInit(&bars[b], 1);
    FenceMbarInit();
    if (kTensor) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(&a.mk) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(&a.mv) : "memory");
    }
  }
  __syncthreads();
  const uint8_t* kb = a.k + size_t(head) * a.n * a.row;
  const uint8_t* vb = a.v + size_t(head) * a.n * a.row;
  auto issue = [&](int t) {
    if (tid != 0 || t >= ntiles) return;
    const uint32_t r0 = lo + t * T, rows = min(T, hi - r0);
    uint8_t* ks = smem + (t % S) * 2 * tileb;
    uint8_t* vs = ks + tileb;
    if (kTensor) {
      // Boxes of 128 bytes (64-byte rows: 64) × T rows (the map's box), row/box of them a
      // tile; a partial last tile reads zeros past the tensor (full box bytes still count).
      const uint32_t boxw = a.row < 128 ? a.row : 128, boxes = a.row / boxw;
      MbarArriveExpect(&bars[t % S], 2 * boxes * T * boxw);
      for (uint32_t b = 0; b < boxes; ++b) {
        const int c0 = int(b * boxw), c1 = int(head * a.n + r0);
        TensorCopy2d(ks + b * T * boxw, &a.mk, c0, c1, &bars[t % S]);
        TensorCopy2d(vs + b * T * boxw, &a.mv, c0, c1, &bars[t % S]);
      }
    } else {
      MbarArriveExpect(&bars[t % S], 2 * rows * a.row);
      BulkCopy(ks, kb + size_t(r0) * a.row, rows * a.row, &bars[t % S]);
      BulkCopy(vs, vb + size_t(r0) * a.row, rows * a.row, &bars[t % S]);
    }
  };
  for (int t = 0; t < S - 1; ++t) issue(t);
  uint32_t acc = 0;
  for (int t = 0; t < ntiles; ++t) {
    issue(t + S - 1);
    MbarWait(&bars[t % S], (t / S) & 1);
    const uint8_t* ks = smem + (t % S) * 2 * tileb;
    const uint32_t q = T / 4;
    acc ^= *reinterpret_cast<const uint32_t*>(ks + (warp * q + lane % q) * a.row + 4 * (lane / q));
    acc ^= *reinterpret_cast<const uint32_t*>(ks + tileb + (warp * q + lane % q) * a.row);
    Spin(a.delay * (T / 16) / 4);  // each warp's quarter of the tile's math
    __syncthreads();
  }
  if (acc == 0x9e3779b9u) a.sink[blockIdx.x] = acc;
#else
  __trap();  // sm_90 only: bulk and tensor copies
#endif
}

// Plain loads: a warp takes U 16-byte pieces a lane in flight (K and V) over its split's rows.
template <int U>
__global__ void __launch_bounds__(128) Direct(const __grid_constant__ Args a) {
  const int tid = threadIdx.x;
  const uint32_t head = blockIdx.y;
  uint32_t lo, hi;
  SplitRange(a, 16, blockIdx.x, lo, hi);
  const uint4* kb = reinterpret_cast<const uint4*>(a.k + (size_t(head) * a.n + lo) * a.row);
  const uint4* vb = reinterpret_cast<const uint4*>(a.v + (size_t(head) * a.n + lo) * a.row);
  const size_t pieces = size_t(hi - lo) * a.row / 16;
  uint32_t acc = 0;
  for (size_t base = 0; base < pieces; base += size_t(U) * 128) {
    uint4 x[U], y[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = base + u * 128 + tid;
      x[u] = i < pieces ? __ldcs(kb + i) : make_uint4(0, 0, 0, 0);
      y[u] = i < pieces ? __ldcs(vb + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= x[u].x ^ x[u].w ^ y[u].y ^ y[u].z;
    Spin(a.delay * U * 128 * 16 / a.row / 16 / 4);
  }
  if (acc == 0x9e3779b9u) a.sink[blockIdx.x] = acc;
}

template <typename F>
double TimeUs(cudaStream_t s, F&& launch, int iters) {
  for (int i = 0; i < 3; ++i) launch();
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 20; ++i) launch();
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaGraphLaunch(exec, s));
  CK(cudaStreamSynchronize(s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int reps = std::max(1, iters / 20);
  CK(cudaEventRecord(e0, s));
  for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(exec, s));
  CK(cudaEventRecord(e1, s));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  return 1000.0 * ms / (reps * 20);
}

// K or V as [heads·rows][row bytes] in boxes of 128 bytes × box_rows rows, 128-byte swizzled
// (64-byte rows: boxes of 64 bytes, 64-byte swizzled).
bool EncodeMap(TensorMapBytes* map, const void* base, uint32_t row, uint64_t rows,
               uint32_t box_rows) {
  const uint64_t dims[2] = {row, rows};
  const uint64_t strides[1] = {row};
  const uint32_t box[2] = {row == 64 ? 64u : 128u, box_rows};
  const TensorSwizzle sw = row == 64 ? TensorSwizzle::k64B : TensorSwizzle::k128B;
  return EncodeTensorMap(map, TensorElem::kU8, 2, base, dims, strides, box, sw).ok();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: pion-gpu-decode-patterns <row_bytes> <N> [heads=8]\n");
    return 2;
  }
  const uint32_t row = std::strtoul(argv[1], nullptr, 10);
  const uint32_t n = std::strtoul(argv[2], nullptr, 10);
  const uint32_t heads = argc > 3 ? std::strtoul(argv[3], nullptr, 10) : 8;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const size_t half = size_t(heads) * n * row;
  uint8_t* buf = nullptr;
  CK(cudaMalloc(&buf, 2 * half));
  {
    std::vector<uint32_t> h(2 * half / 4);
    uint32_t x = 12345;
    for (auto& w : h) x = x * 1664525u + 1013904223u, w = x;
    CK(cudaMemcpy(buf, h.data(), 2 * half, cudaMemcpyHostToDevice));
  }
  uint32_t* sink = nullptr;
  CK(cudaMalloc(&sink, 1 << 20));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int iters = 2 * half > 3e8 ? 200 : 1000;
  const double bytes = 2.0 * half;
  auto report = [&](const std::string& name, uint32_t splits, uint32_t delay, double us) {
    std::printf(
        "{\"pattern\": \"%s\", \"row\": %u, \"n\": %u, \"splits\": %u, \"delay\": %u, "
        "\"us\": %.2f, \"tbps\": %.3f}\n",
        name.c_str(), row, n, splits, delay, us, bytes / us / 1e6);
    std::fflush(stdout);
  };
  auto stream = [&] { LaunchStreamRead(buf, 2 * half, sink, sms, s); };
  const double stream_us = TimeUs(s, stream, iters);
  report("stream", 0, 0, stream_us);
  Args a{};
  a.k = buf;
  a.v = buf + half;
  a.heads = heads;
  a.n = n;
  a.row = row;
  a.sink = sink;
  for (uint32_t delay : {0u, 600u}) {
    a.delay = delay;
    // Warp rings, as the decode: 2 blocks an SM at 33 splits (fp16 d = 128).
    for (uint32_t splits : {uint32_t(2 * sms / heads), uint32_t(sms / heads)}) {
      a.splits = splits;
      for (uint32_t mode : {0u, 1u, 2u}) {
        a.mode = mode;
        const size_t sm_cp = 4 * 3 * 2 * 16 * size_t(row + 16);
        CK(cudaFuncSetAttribute(WarpRing<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                int(sm_cp)));
        report("warp_cpasync_m" + std::to_string(mode), splits, delay,
               TimeUs(
                   s, [&] { WarpRing<false><<<dim3(splits, heads), 128, sm_cp, s>>>(a); }, iters));
        const size_t sm_b = 4 * 3 * 2 * 16 * size_t(row);
        CK(cudaFuncSetAttribute(WarpRing<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                int(sm_b)));
        report("warp_bulk_m" + std::to_string(mode), splits, delay,
               TimeUs(
                   s, [&] { WarpRing<true><<<dim3(splits, heads), 128, sm_b, s>>>(a); }, iters));
      }
    }
    // Block rings: T rows a tile, S stages.
    for (uint32_t T : {32u, 64u, 128u}) {
      for (int S : {2, 3, 4}) {
        const size_t sm = size_t(S) * 2 * T * row + 1024;
        if (sm > 220 * 1024) continue;
        const int per_sm = std::max(1, int((228 * 1024) / (sm + 2048)));
        for (uint32_t splits :
             {uint32_t(per_sm * sms / heads), uint32_t(std::max(1, per_sm / 2) * sms / heads)}) {
          a.splits = std::max(1u, splits);
          for (int tensor = 0; tensor < 2; ++tensor) {
            if (tensor && ((row % 128 != 0 && row != 64) ||
                           !EncodeMap(&a.mk, a.k, row, uint64_t(heads) * n, T) ||
                           !EncodeMap(&a.mv, a.v, row, uint64_t(heads) * n, T))) {
              continue;
            }
            auto run = [&](auto kernel) {
              CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(sm)));
              return TimeUs(
                  s, [&] { kernel<<<dim3(a.splits, heads), 128, sm, s>>>(a, T); }, iters);
            };
            double us = 0;
            if (S == 2) us = tensor ? run(BlockRing<2, true>) : run(BlockRing<2, false>);
            if (S == 3) us = tensor ? run(BlockRing<3, true>) : run(BlockRing<3, false>);
            if (S == 4) us = tensor ? run(BlockRing<4, true>) : run(BlockRing<4, false>);
            report(std::string(tensor ? "block_tensor" : "block_bulk") + "_T" + std::to_string(T) +
                       "_S" + std::to_string(S),
                   a.splits, delay, us);
          }
        }
      }
    }
    // Plain loads.
    for (uint32_t per_sm : {4u, 8u, 16u}) {
      a.splits = per_sm * sms / heads;
      report("direct_u4_b" + std::to_string(per_sm), a.splits, delay,
             TimeUs(
                 s, [&] { Direct<4><<<dim3(a.splits, heads), 128, 0, s>>>(a); }, iters));
      report("direct_u8_b" + std::to_string(per_sm), a.splits, delay,
             TimeUs(
                 s, [&] { Direct<8><<<dim3(a.splits, heads), 128, 0, s>>>(a); }, iters));
    }
  }
  report("stream", 0, 0, TimeUs(s, stream, iters));
  return 0;
}
