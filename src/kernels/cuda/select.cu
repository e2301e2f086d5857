// Selection on the GPU: exact scores and per-row top-k (QUERY with top_k), block summaries,
// block scores and per-head block choice (QUERY_SPARSE_AUTO). Top-k is a radix select over
// order-preserving keys (up to four 8-bit passes of a block-wide histogram), then one ordered
// compaction pass that emits the chosen indices ascending — ties at the threshold go to the
// lower index, as the CPU executor breaks them — and sums the softmax mass left out.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_select.cuh"

namespace pion::kernels::cuda {
namespace {

constexpr int kSelThreads = 512;
constexpr int kSmemBlocks = 2048;  // block candidates a block select stages in shared memory
constexpr int kMaxGroup = 1024;    // SHARED: the most query heads of one K/V head (all of H_q)

template <typename T>
__device__ inline float ToF(T x) {
  return static_cast<float>(x);
}
template <>
__device__ inline float ToF<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ inline float ToF<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
// e4m3fn → fp32, exact (through fp16); its row's scale is applied by the caller.
template <>
__device__ inline float ToF<__nv_fp8_e4m3>(__nv_fp8_e4m3 x) {
  return static_cast<float>(x);
}

// Visible keys [lo, hi) of query row r over a prefix at positions 0..rows-1.
__device__ inline void RowRange(const AttendArgs& a, uint32_t r, uint32_t* lo, uint32_t* hi) {
  const int64_t p = a.q_pos0 + static_cast<int64_t>(r % a.m);
  const int64_t b = Max<int64_t>(0, FirstVisible(p, a.window, a.k_pos0));
  const int64_t e = Min<int64_t>(a.rows, p - a.k_pos0 + 1);
  *lo = static_cast<uint32_t>(b < e ? b : 0);
  *hi = static_cast<uint32_t>(b < e ? e : 0);
}

constexpr int kScoreChunk = 2048;

template <typename T>
__global__ void __launch_bounds__(256)
    Scores(AttendArgs a, const int32_t* head_map, uint32_t row0, float* scores) {
  __shared__ float q[512];
  const uint32_t r = row0 + blockIdx.x;
  const uint32_t h = r / a.m;
  const int32_t kv = head_map[h];
  for (uint32_t x = threadIdx.x; x < a.d; x += blockDim.x) q[x] = a.q[size_t{r} * a.d + x];
  __syncthreads();
  uint32_t lo, hi;
  RowRange(a, r, &lo, &hi);
  const uint32_t t0 = lo + blockIdx.y * kScoreChunk;
  const uint32_t t1 = min(hi, t0 + kScoreChunk);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* k = static_cast<const T*>(a.k) + size_t{static_cast<uint32_t>(kv)} * a.rows * a.d;
  for (uint32_t t = t0 + warp; t < t1; t += blockDim.x / 32) {
    const T* kr = k + size_t{t} * a.d;
    float acc = 0.f;
    for (uint32_t x = lane; x < a.d; x += 32) acc = fmaf(q[x], ToF(kr[x]), acc);
    acc = WarpSum(acc);
    if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) {  // q · (e4m3 · scale) = (q · e4m3) · scale
      acc *= a.k_scale[size_t{static_cast<uint32_t>(kv)} * a.rows + t];
    }
    if (lane == 0) scores[size_t{blockIdx.x} * a.rows + t] = acc * a.scale;
  }
}

__global__ void __launch_bounds__(kSelThreads, 1)
    SelectRows(AttendArgs a, uint32_t row0, const float* scores, uint32_t top_k, int32_t* list,
               int32_t* counts, float* omitted, uint8_t* exact) {
  const uint32_t r = row0 + blockIdx.x;
  uint32_t lo, hi;
  RowRange(a, r, &lo, &hi);
  const int n = static_cast<int>(hi - lo);
  const int keep = Min<int>(static_cast<int>(top_k), n);
  int32_t* out = list + size_t{r} * top_k;
  if (keep == n) {  // every visible key (or none)
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = static_cast<int32_t>(lo + i);
    if (threadIdx.x == 0) {
      counts[r] = n;
      omitted[r] = 0.f;
      exact[r] = 1;
    }
    return;
  }
  const float* s = scores + size_t{blockIdx.x} * a.rows + lo;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, s[i]);
  mx = BlockReduce(mx, MaxOp{}, -INFINITY);
  auto key = [s](int i) { return SortKey(s[i]); };
  const Threshold th = RadixSelect<kSelThreads>(key, n, keep);
  float all = 0.f, left = 0.f;
  CompactAscending<kSelThreads>(key, n, th, [&](int i, bool taken, int rank) {
    const float w = expf(s[i] - mx);
    all += w;
    if (taken) {
      out[rank] = static_cast<int32_t>(lo + i);
    } else {
      left += w;
    }
  });
  all = BlockReduce(all, SumOp{}, 0.f);
  left = BlockReduce(left, SumOp{}, 0.f);
  if (threadIdx.x == 0) {
    counts[r] = keep;
    omitted[r] = all > 0.f ? left / all : 0.f;
    exact[r] = 0;
  }
}

// scales: fp8 row scales (null otherwise), so the summaries are of e4m3 × scale, the decoded
// values, as on the CPU.
template <typename T>
__global__ void Summarize(const T* k, const float* scales, uint32_t rows, uint32_t d,
                          uint32_t block, uint32_t nb, float* mean, float* mn, float* mx) {
  const uint32_t b = blockIdx.x, h = blockIdx.y;
  const uint32_t first = b * block, last = min(rows, first + block);
  for (uint32_t x = threadIdx.x; x < d; x += blockDim.x) {
    float sum = 0.f, lo = INFINITY, hi = -INFINITY;
    for (uint32_t t = first; t < last; ++t) {
      float v = ToF(k[(size_t{h} * rows + t) * d + x]);
      if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) v *= scales[size_t{h} * rows + t];
      sum += v;
      lo = fminf(lo, v);
      hi = fmaxf(hi, v);
    }
    const size_t o = (size_t{h} * nb + b) * d + x;
    const uint32_t count = last > first ? last - first : 0;
    mean[o] = count ? sum / count : 0.f;
    mn[o] = count ? lo : 0.f;
    mx[o] = count ? hi : 0.f;
  }
}

// A warp scores kScoreRun consecutive blocks of one query head: its loads for all of them are
// issued before the reductions, so they overlap. Lanes own 4-column slices (float4: one load a
// block and summary at d = 128; d is a multiple of 32).
constexpr int kScoreWarps = 8;
constexpr int kScoreRun = 8;

template <bool kQuest>
__global__ void __launch_bounds__(256)
    ScoreBlocks(const float* q, uint32_t d, const int32_t* head_map, const float* mean,
                const float* mn, const float* mx, uint32_t nb, float* sel, float* mean_scores,
                uint32_t force_lo, uint32_t force_hi) {
  const uint32_t h = blockIdx.y;
  const uint32_t b0 = (blockIdx.x * kScoreWarps + (threadIdx.x >> 5)) * kScoreRun;
  const int lane = threadIdx.x & 31;
  if (b0 >= nb) return;
  const uint32_t d4 = d / 4;
  const float4* qh = reinterpret_cast<const float4*>(q + size_t{h} * d);
  const size_t head = size_t{static_cast<uint32_t>(head_map[h])} * nb;
  const float4* mean4 = reinterpret_cast<const float4*>(mean);
  const float4* mn4 = reinterpret_cast<const float4*>(mn);
  const float4* mx4 = reinterpret_cast<const float4*>(mx);
  float dot[kScoreRun], bound[kScoreRun];
#pragma unroll
  for (int r = 0; r < kScoreRun; ++r) dot[r] = bound[r] = 0.f;
  for (uint32_t x = lane; x < d4; x += 32) {
    const float4 qx = __ldg(qh + x);
    float4 mv[kScoreRun], lo[kScoreRun], hi[kScoreRun];
#pragma unroll
    for (int r = 0; r < kScoreRun; ++r) {
      const size_t i = (head + Min<uint32_t>(b0 + r, nb - 1)) * d4 + x;
      mv[r] = __ldg(mean4 + i);
      if (kQuest) lo[r] = __ldg(mn4 + i), hi[r] = __ldg(mx4 + i);
    }
#pragma unroll
    for (int r = 0; r < kScoreRun; ++r) {
      dot[r] += Dot4(qx, mv[r]);
      if (kQuest) bound[r] += Bound4(qx, lo[r], hi[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < kScoreRun; ++r) {
    dot[r] = WarpSum(dot[r]);
    if (kQuest) bound[r] = WarpSum(bound[r]);
  }
  if (lane < kScoreRun && b0 + lane < nb) {
    float dv = 0.f, bv = 0.f;
#pragma unroll
    for (int r = 0; r < kScoreRun; ++r) {
      if (r == lane) dv = dot[r], bv = bound[r];
    }
    const uint32_t b = b0 + lane;
    mean_scores[size_t{h} * nb + b] = dv;
    sel[size_t{h} * nb + b] = b >= force_lo && b < force_hi ? INFINITY : kQuest ? bv : dv;
  }
}

__global__ void __launch_bounds__(kSelThreads, 1)
    SelectBlocks(const float* sel, const float* ms, const int32_t* head_map, uint32_t hq,
                 bool shared, uint32_t nb, uint32_t B, uint32_t lo, uint32_t hi, uint32_t k_top,
                 float scale, int32_t* blocks, int32_t* nchosen, int32_t* list, int32_t* counts,
                 uint32_t stride, float* omitted) {
  __shared__ uint32_t skeys[kSmemBlocks];
  __shared__ float sms[kSmemBlocks];       // scale · q·mean of the candidates
  __shared__ int32_t chosen[kSmemBlocks];  // the chosen middle blocks, ascending (keep <= it)
  __shared__ int32_t members[kMaxGroup];
  __shared__ int n_members;
  const uint32_t h = blockIdx.x;
  const uint32_t b_lo = lo / B, b_hi = (hi - 1) / B;
  const float* hs = sel + size_t{h} * nb;
  const float* hm = ms + size_t{h} * nb;
  if (shared) {  // the group's heads (any order: the max does not depend on it)
    if (threadIdx.x == 0) n_members = 0;
    __syncthreads();
    for (uint32_t t = threadIdx.x; t < hq; t += blockDim.x) {
      if (head_map[t] == head_map[h]) members[atomicAdd(&n_members, 1)] = static_cast<int32_t>(t);
    }
    __syncthreads();
  }
  auto score_of = [&](uint32_t b) {
    if (!shared) return hs[b];
    float m = -INFINITY;
    for (int j = 0; j < n_members; ++j) m = fmaxf(m, sel[size_t(members[j]) * nb + b]);
    return m;
  };
  const int ncand = b_hi > b_lo ? static_cast<int>(b_hi - b_lo - 1) : 0;
  const bool staged = ncand <= kSmemBlocks;
  float top = -INFINITY;
  if (staged) {
    // Every load of a thread in flight at once: the visible blocks' mean scores (and, per
    // head, their selection scores), then (SHARED) the members' scores, max-ed per candidate.
    constexpr int kPer = (kSmemBlocks + 2 + kSelThreads - 1) / kSelThreads;
    const int nvis = static_cast<int>(b_hi - b_lo + 1);
    float x[kPer], key[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = static_cast<int>(threadIdx.x) + j * kSelThreads;
      x[j] = i < nvis ? hm[b_lo + i] : -INFINITY;
      key[j] = i < nvis && !shared ? hs[b_lo + i] : -INFINITY;
    }
    if (shared) {  // four members' loads in flight at a time
      for (int m0 = 0; m0 < n_members; m0 += 4) {
        float v[4][kPer];
#pragma unroll
        for (int mm = 0; mm < 4; ++mm) {
          const float* ps = m0 + mm < n_members ? sel + size_t(members[m0 + mm]) * nb : nullptr;
#pragma unroll
          for (int j = 0; j < kPer; ++j) {
            const int i = static_cast<int>(threadIdx.x) + j * kSelThreads;
            v[mm][j] = ps != nullptr && i < nvis ? ps[b_lo + i] : -INFINITY;
          }
        }
#pragma unroll
        for (int j = 0; j < kPer; ++j)
          key[j] = fmaxf(key[j], fmaxf(fmaxf(v[0][j], v[1][j]), fmaxf(v[2][j], v[3][j])));
      }
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = static_cast<int>(threadIdx.x) + j * kSelThreads - 1;  // candidate index
      top = fmaxf(top, x[j] * scale);
      if (i >= 0 && i < ncand) {
        sms[i] = x[j] * scale;
        skeys[i] = SortKey(key[j]);
      }
    }
  } else {
    for (uint32_t b = b_lo + threadIdx.x; b <= b_hi; b += blockDim.x)
      top = fmaxf(top, hm[b] * scale);
  }
  top = BlockReduce(top, MaxOp{}, -INFINITY);  // its barriers also publish skeys and sms
  auto weight_of = [&](uint32_t b) {
    const uint32_t r0 = max(b * B, lo), r1 = min((b + 1) * B, hi);
    const int i = static_cast<int>(b - b_lo) - 1;
    const float x = staged && i >= 0 && i < ncand ? sms[i] : hm[b] * scale;
    return static_cast<float>(r1 - r0) * expf(x - top);
  };

  const int keep = Min<int>(static_cast<int>(k_top), ncand);
  int32_t* hb = blocks + size_t{h} * (k_top + 2);
  int32_t* hl = list + size_t{h} * stride;
  const uint32_t len0 = min((b_lo + 1) * B, hi) - lo;
  const bool two = b_hi != b_lo;
  // The first and last visible blocks, always chosen.
  for (uint32_t t = threadIdx.x; t < len0; t += blockDim.x) hl[t] = static_cast<int32_t>(lo + t);
  if (two) {
    const uint32_t off = len0 + static_cast<uint32_t>(keep) * B;
    for (uint32_t t = b_hi * B + threadIdx.x; t < hi; t += blockDim.x) {
      hl[off + t - b_hi * B] = static_cast<int32_t>(t);
    }
  }
  float all = 0.f, left = 0.f;
  auto visit = [&](int i, bool taken, int rank) {
    const uint32_t b = b_lo + 1 + static_cast<uint32_t>(i);
    const float w = weight_of(b);
    all += w;
    if (!taken) {
      left += w;
      return;
    }
    hb[1 + rank] = static_cast<int32_t>(b);  // its rows: written below by the whole block
    if (rank < kSmemBlocks) chosen[rank] = static_cast<int32_t>(b);
  };
  if (keep == ncand || keep == 0) {
    for (int i = threadIdx.x; i < ncand; i += blockDim.x) visit(i, keep > 0, i);
  } else if (staged) {
    auto key = [](int i) { return skeys[i]; };
    CompactAscending<kSelThreads>(key, ncand, RadixSelect<kSelThreads>(key, ncand, keep), visit);
  } else {
    auto key = [&](int i) { return SortKey(score_of(b_lo + 1 + static_cast<uint32_t>(i))); };
    CompactAscending<kSelThreads>(key, ncand, RadixSelect<kSelThreads>(key, ncand, keep), visit);
  }
  all = BlockReduce(all, SumOp{}, 0.f);  // its barriers also publish hb
  left = BlockReduce(left, SumOp{}, 0.f);
  // The chosen middle blocks' rows, ascending, every thread writing consecutive entries.
  const int32_t* cb = keep <= kSmemBlocks ? chosen : hb + 1;  // shared memory when it fits
  for (uint32_t e = threadIdx.x; e < static_cast<uint32_t>(keep) * B; e += blockDim.x) {
    hl[len0 + e] = cb[e / B] * static_cast<int32_t>(B) + static_cast<int32_t>(e % B);
  }
  if (threadIdx.x == 0) {
    all += weight_of(b_lo) + (two ? weight_of(b_hi) : 0.f);
    hb[0] = static_cast<int32_t>(b_lo);
    if (two) hb[1 + keep] = static_cast<int32_t>(b_hi);
    nchosen[h] = 1 + keep + (two ? 1 : 0);
    counts[h] =
        static_cast<int32_t>(len0 + static_cast<uint32_t>(keep) * B + (two ? hi - b_hi * B : 0));
    omitted[h] = all > 0.f ? left / all : 0.f;
  }
}

}  // namespace

Status LaunchScores(const AttendArgs& a, const int32_t* head_map, uint32_t row0, uint32_t n,
                    float* scores, void* stream) {
  if (n == 0 || a.rows == 0) return Status::Ok();
  dim3 grid(n, (a.rows + kScoreChunk - 1) / kScoreChunk);
  auto s = static_cast<cudaStream_t>(stream);
  if (a.dtype == DType::kF16) {
    Scores<__half><<<grid, 256, 0, s>>>(a, head_map, row0, scores);
  } else if (a.dtype == DType::kFP8) {
    if (a.k_scale == nullptr) return Status(ErrorKind::kErr, "fp8 scores need K's row scales");
    Scores<__nv_fp8_e4m3><<<grid, 256, 0, s>>>(a, head_map, row0, scores);
  } else if (a.dtype == DType::kBF16) {
    Scores<__nv_bfloat16><<<grid, 256, 0, s>>>(a, head_map, row0, scores);
  } else {
    Scores<float><<<grid, 256, 0, s>>>(a, head_map, row0, scores);
  }
  return KernelStatus("scores kernel");
}

Status LaunchSelectRows(const AttendArgs& a, uint32_t row0, uint32_t n, const float* scores,
                        uint32_t top_k, int32_t* list, int32_t* counts, float* omitted,
                        uint8_t* exact, void* stream) {
  if (n == 0) return Status::Ok();
  SelectRows<<<n, kSelThreads, 0, static_cast<cudaStream_t>(stream)>>>(a, row0, scores, top_k, list,
                                                                       counts, omitted, exact);
  return KernelStatus("top-k select kernel");
}

Status LaunchSummarize(const void* k, DType dtype, const float* scales, uint32_t heads,
                       uint32_t rows, uint32_t d, uint32_t block, uint32_t nblocks, float* mean,
                       float* min, float* max, void* stream) {
  if (heads == 0 || nblocks == 0) return Status::Ok();
  dim3 grid(nblocks, heads);
  const uint32_t threads = std::min<uint32_t>(d, 512);
  auto s = static_cast<cudaStream_t>(stream);
  if (dtype == DType::kF16) {
    Summarize<<<grid, threads, 0, s>>>(static_cast<const __half*>(k), nullptr, rows, d, block,
                                       nblocks, mean, min, max);
  } else if (dtype == DType::kFP8) {
    if (scales == nullptr) return Status(ErrorKind::kErr, "fp8 summaries need K's row scales");
    Summarize<<<grid, threads, 0, s>>>(static_cast<const __nv_fp8_e4m3*>(k), scales, rows, d, block,
                                       nblocks, mean, min, max);
  } else if (dtype == DType::kBF16) {
    Summarize<<<grid, threads, 0, s>>>(static_cast<const __nv_bfloat16*>(k), nullptr, rows, d,
                                       block, nblocks, mean, min, max);
  } else {
    Summarize<<<grid, threads, 0, s>>>(static_cast<const float*>(k), nullptr, rows, d, block,
                                       nblocks, mean, min, max);
  }
  return KernelStatus("summarize kernel");
}

Status LaunchScoreBlocks(const float* q, uint32_t hq, uint32_t d, const int32_t* head_map,
                         const float* mean, const float* min, const float* max, uint32_t nblocks,
                         BlockSelector selector, float* sel, float* mean_scores, void* stream,
                         uint32_t force_lo, uint32_t force_hi) {
  if (hq == 0 || nblocks == 0) return Status::Ok();
  dim3 grid((nblocks + kScoreWarps * kScoreRun - 1) / (kScoreWarps * kScoreRun), hq);
  auto st = static_cast<cudaStream_t>(stream);
  if (selector == BlockSelector::kQuest) {
    ScoreBlocks<true><<<grid, 32 * kScoreWarps, 0, st>>>(q, d, head_map, mean, min, max, nblocks,
                                                         sel, mean_scores, force_lo, force_hi);
  } else {
    ScoreBlocks<false><<<grid, 32 * kScoreWarps, 0, st>>>(q, d, head_map, mean, min, max, nblocks,
                                                          sel, mean_scores, force_lo, force_hi);
  }
  return KernelStatus("block score kernel");
}

Status LaunchSelectBlocks(const float* sel, const float* mean_scores, const int32_t* head_map,
                          uint32_t hq, bool shared, uint32_t nblocks, uint32_t block, uint32_t lo,
                          uint32_t hi, uint32_t k_top, float scale, int32_t* blocks,
                          int32_t* nchosen, int32_t* list, int32_t* counts, uint32_t stride,
                          float* omitted, void* stream) {
  if (hq == 0 || hi <= lo) return Status::Ok();
  if (shared && hq > static_cast<uint32_t>(kMaxGroup)) {
    return Status(ErrorKind::kErr, "SHARED block selection takes at most " +
                                       std::to_string(kMaxGroup) + " query heads");
  }
  SelectBlocks<<<hq, kSelThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      sel, mean_scores, head_map, hq, shared, nblocks, block, lo, hi, k_top, scale, blocks, nchosen,
      list, counts, stride, omitted);
  return KernelStatus("block select kernel");
}

}  // namespace pion::kernels::cuda
