// The batched tensor-core kernel for fp16 K/V with many query rows per K/V head (M > 1 or wide
// GQA groups; d <= 128): flash attention on mma.sync m16n8k16 where each of the block's four warps
// owns two 16-row groups (32 rows, 128 a block), so every K and V fragment read from shared
// memory feeds two MMAs, and each K/V tile (32 keys, three cp.async stages) serves 128 rows.
// Q and P enter the tensor cores as fp16 (flash-attention precision); the online softmax,
// partials, LSE and output stay fp32. Same arguments and partial layout as the other kernels.
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_mma.cuh"

namespace pion::kernels::cuda {
namespace {

template <int D>
struct Batched {
  static constexpr int kMt = 2;            // 16-row groups per warp
  static constexpr int kGroups = 4 * kMt;  // 16-row groups (items) per block
  static constexpr int kRows = 16 * kGroups;
  static constexpr int kBn = 32;  // keys per tile
  static constexpr int kStages = 3;
  static constexpr int kStr = D + 8;  // padded smem row (halves): ldmatrix rows hit distinct banks
  static constexpr size_t kQ = size_t{kRows} * kStr * 2;
  static constexpr size_t kTile = size_t{kBn} * kStr * 2;
  static constexpr size_t kBytes = kQ + 2 * kStages * kTile;
};

template <int D>
__global__ void __launch_bounds__(128) BatchedKernel(AttendArgs a) {
  using C = Batched<D>;
  constexpr int kStr = C::kStr, kBn = C::kBn, kS = C::kStages, kMt = C::kMt;
  constexpr int kNt = kBn / 8;  // 8-key MMA tiles per K/V tile
  extern __shared__ __align__(16) uint8_t smem[];
  __half* qs = reinterpret_cast<__half*>(smem);          // [kRows][kStr]
  __half* kt = reinterpret_cast<__half*>(smem + C::kQ);  // [kS][kBn][kStr]
  __half* vt = kt + kS * kBn * kStr;                     // [kS][kBn][kStr]
  __shared__ int64_t qpos[C::kRows];
  __shared__ int32_t rowid[C::kRows];
  __shared__ uint32_t range[2];
  __shared__ int64_t qspan[2];

  WaitForPrimary();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t first_item = blockIdx.x * C::kGroups;
  const int32_t kv = a.items[first_item].kv;
  for (int t = tid; t < C::kRows; t += 128) {
    const uint32_t it = first_item + t / 16;
    const int j = t % 16;
    int32_t r = -1;
    if (it < a.n_items && j < a.items[it].n) r = a.items[it].rows[j];
    rowid[t] = r;
    qpos[t] = r >= 0 ? a.q_pos0 + static_cast<int64_t>(r % a.m) : 0;
  }
  if (tid == 0) {  // an item's rows ascend by query position: its first and last bound it
    int64_t pmin = INT64_MAX, pmax = INT64_MIN;
    for (int i = 0; i < C::kGroups; ++i) {
      const uint32_t it = first_item + i;
      if (it >= a.n_items || a.items[it].n == 0) continue;
      pmin = Min<int64_t>(pmin, a.q_pos0 + a.items[it].rows[0] % a.m);
      pmax = Max<int64_t>(pmax, a.q_pos0 + a.items[it].rows[a.items[it].n - 1] % a.m);
    }
    qspan[0] = pmin;
    qspan[1] = pmax;
    uint32_t lo = 0, hi = 0;
    if (pmin <= pmax) {
      const int64_t b = Max<int64_t>(FirstVisible(pmin, a.window, a.k_pos0), a.begin);
      const int64_t e = Min<int64_t>(pmax - a.k_pos0 + 1, a.end);
      lo = static_cast<uint32_t>(b < e ? b : 0);
      hi = static_cast<uint32_t>(b < e ? e : 0);
    }
    range[0] = lo;
    range[1] = hi - lo;
  }
  __syncthreads();
  // This split's tiles: the range's 32-key tiles spread evenly over the splits.
  const uint32_t lo = range[0], len = range[1];
  const uint32_t tiles = (len + kBn - 1) / kBn;
  const uint32_t k0 = lo + Min<uint32_t>(len, SplitPoint(tiles, blockIdx.y, a.splits) * kBn);
  const uint32_t k1 = lo + Min<uint32_t>(len, SplitPoint(tiles, blockIdx.y + 1, a.splits) * kBn);
  const int ntiles = static_cast<int>((k1 - k0 + kBn - 1) / kBn);
  const __half* kbase = static_cast<const __half*>(a.k) + size_t(kv) * a.rows * D;
  const __half* vbase = static_cast<const __half*>(a.v) + size_t(kv) * a.rows * D;

  // Tile t into buffer t % kS; one commit group per call (empty past the end), so that
  // wait_prior(kS − 1) means "tile t has landed". kBn × D/8 chunks of 16 bytes over 128 threads.
  constexpr int kCpr = D / 8;
  constexpr int kChunks = kBn * kCpr / 128;
  auto prefetch = [&](int t) {
    if (t < ntiles) {
      const int buf = t % kS;
      const uint32_t first = k0 + t * kBn;
      const int tk = Min<int>(kBn, k1 - first);
      const __half* kg = kbase + size_t(first) * D;
      const __half* vg = vbase + size_t(first) * D;
      __half* ks = kt + buf * kBn * kStr;
      __half* vs = vt + buf * kBn * kStr;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int e = tid + 128 * i;
        const int j = e / kCpr, c = (e % kCpr) * 8;
        if (j < tk) {
          CpAsync16(ks + j * kStr + c, kg + j * D + c);
          CpAsync16(vs + j * kStr + c, vg + j * D + c);
        } else {  // zero rows past the range: p = 0 must not meet garbage (0 · NaN)
          *reinterpret_cast<uint4*>(ks + j * kStr + c) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(vs + j * kStr + c) = make_uint4(0, 0, 0, 0);
        }
      }
    }
    __pipeline_commit();
  };

  const int g = lane >> 2, c2 = (lane & 3) * 2;
  const int lm = lane >> 3, lr = lane & 7;
  // This thread's rows: for each of its warp's groups mt, rows g and g + 8 (index mt*2 + half).
  int64_t qp[kMt * 2];
  bool valid[kMt * 2];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = (warp * kMt + mt) * 16 + g + 8 * h;
      qp[mt * 2 + h] = qpos[row];
      valid[mt * 2 + h] = rowid[row] >= 0;
    }
  }
  const int64_t qmin = qspan[0], qmax = qspan[1];
  const float sl2 = a.scale * kLog2e;
  float m_run[kMt * 2], l_run[kMt * 2];
  float o[kMt][D / 8][4];
#pragma unroll
  for (int i = 0; i < kMt * 2; ++i) m_run[i] = -INFINITY, l_run[i] = 0.f;
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;

#pragma unroll
  for (int t = 0; t < kS - 1; ++t) prefetch(t);
    // Q (fp16) into shared memory while the first tiles are on their way (loads 4 at a time).
#pragma unroll 4
  for (int e = tid; e < C::kRows * D / 4; e += 128) {
    const int r = e / (D / 4), c = (e % (D / 4)) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (rowid[r] >= 0) x = *reinterpret_cast<const float4*>(a.q + size_t(rowid[r]) * D + c);
    *reinterpret_cast<uint2*>(qs + r * kStr + c) = uint2{Pack(x.x, x.y), Pack(x.z, x.w)};
  }
  __syncthreads();
  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % kS;
    prefetch(t + kS - 1);
    __pipeline_wait_prior(kS - 1);
    __syncthreads();
    const __half* kb = kt + buf * kBn * kStr;
    const __half* vb = vt + buf * kBn * kStr;
    float s[kMt][kNt][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int n = 0; n < kNt; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
        // S = Q·Kᵀ: each K fragment feeds both row groups.
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t b[kNt / 2][4];
#pragma unroll
      for (int j = 0; j < kNt / 2; ++j)
        Ldm4(b[j], kb + (j * 16 + (lm >> 1) * 8 + lr) * kStr + ks * 16 + (lm & 1) * 8);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        uint32_t aq[4];
        const int qr = (warp * kMt + mt) * 16 + (lm & 1) * 8 + lr;
        Ldm4(aq, qs + qr * kStr + ks * 16 + (lm >> 1) * 8);
#pragma unroll
        for (int j = 0; j < kNt / 2; ++j) {
          Mma(s[mt][2 * j], aq, b[j][0], b[j][1]);
          Mma(s[mt][2 * j + 1], aq, b[j][2], b[j][3]);
        }
      }
    }
    // Mask (position, window, range, padding rows), scale into the log2 domain, row max. A
    // tile every row of the block fully sees skips the per-key tests.
    const int64_t e0 = int64_t(k0) + t * kBn;
    const bool full = e0 + kBn <= k1 && a.k_pos0 + e0 + kBn - 1 <= qmin &&
                      (a.window <= 0 || a.k_pos0 + e0 > qmax - a.window);
    float alpha[kMt * 2];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < kNt; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          bool ok = valid[mt * 2 + h];
          if (!full) {
            const int64_t entry = e0 + n * 8 + c2 + (e & 1);
            const int64_t kpos = a.k_pos0 + entry;
            const int64_t q = qp[mt * 2 + h];
            ok = ok && entry < k1 && kpos <= q && (a.window <= 0 || kpos > q - a.window);
          }
          s[mt][n][e] = ok ? s[mt][n][e] * sl2 : -INFINITY;
          mx[h] = fmaxf(mx[h], s[mt][n][e]);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = mt * 2 + h;
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float m_new = fmaxf(m_run[i], mx[h]);
        alpha[i] = m_new == -INFINITY ? 1.f : exp2f(m_run[i] - m_new);
        m_run[i] = m_new;
        l_run[i] *= alpha[i];
      }
#pragma unroll
      for (int n = 0; n < kNt; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = mt * 2 + (e >> 1);
          const float p = m_run[i] == -INFINITY ? 0.f : exp2f(s[mt][n][e] - m_run[i]);
          s[mt][n][e] = p;
          l_run[i] += p;
        }
      }
    }
    // Once the running maxima settle the factors are 1: skip the rescale (warp-uniform test).
    bool rescale = false;
#pragma unroll
    for (int i = 0; i < kMt * 2; ++i) rescale = rescale || alpha[i] != 1.f;
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          o[mt][n][0] *= alpha[mt * 2];
          o[mt][n][1] *= alpha[mt * 2];
          o[mt][n][2] *= alpha[mt * 2 + 1];
          o[mt][n][3] *= alpha[mt * 2 + 1];
        }
    }
    // O += P·V, 16 keys at a time: each V fragment feeds both row groups.
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk) {
      uint32_t ph[kMt][4];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        ph[mt][0] = Pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        ph[mt][1] = Pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        ph[mt][2] = Pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        ph[mt][3] = Pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t b[4];
        Ldm4T(b, vb + (kk * 16 + (lm & 1) * 8 + lr) * kStr + dn * 16 + (lm >> 1) * 8);
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          Mma(o[mt][2 * dn], ph[mt], b[0], b[1]);
          Mma(o[mt][2 * dn + 1], ph[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the buffer is refilled next iteration
  }
  LaunchDependents();
  // Row sums over the quad, then each warp writes its rows' partials (m in natural log units).
  const size_t part = a.part0 + blockIdx.y;
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = mt * 2 + h;
      float l = l_run[i];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = (warp * kMt + mt) * 16 + g + 8 * h;
      if (rowid[row] < 0) continue;
      const size_t pr = part * a.nrows + size_t(rowid[row]);
      if ((lane & 3) == 0) {
        a.part_m[pr] = m_run[i] == -INFINITY ? -INFINITY : m_run[i] * kLn2;
        a.part_l[pr] = l;
      }
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        *reinterpret_cast<float2*>(a.part_o + pr * D + n * 8 + c2) =
            make_float2(o[mt][n][2 * h], o[mt][n][2 * h + 1]);
      }
    }
  }
  FinishSplits(a, rowid, C::kRows);
}

// The kernel for D with its dynamic shared memory allowed (once), or the error that refused it.
template <int D>
cudaError_t Prepare() {
  static const cudaError_t attr =
      cudaFuncSetAttribute(BatchedKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Batched<D>::kBytes));
  return attr;
}

// Resident blocks per multiprocessor (registers bound this kernel before shared memory does).
template <int D>
int BlocksPerSm() {
  static const int n = [] {
    int blocks = 1;
    if (Prepare<D>() != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, BatchedKernel<D>, 128,
                                                      Batched<D>::kBytes) != cudaSuccess) {
      cudaGetLastError();
      return 1;
    }
    return std::max(blocks, 1);
  }();
  return n;
}

template <int D>
Status Launch(const AttendArgs& a, cudaStream_t stream) {
  using C = Batched<D>;
  const cudaError_t attr = Prepare<D>();
  if (attr != cudaSuccess) return gpu::CudaError(attr, "batched tensor-core kernel shared memory");
  dim3 grid((a.n_items + C::kGroups - 1) / C::kGroups, a.splits);
  return LaunchDependent(BatchedKernel<D>, grid, dim3(128), C::kBytes, stream,
                         "batched tensor-core attention kernel", a);
}

}  // namespace

int BatchedBlocksPerSm(uint32_t d) {
  switch (d) {
    case 32:
      return BlocksPerSm<32>();
    case 64:
      return BlocksPerSm<64>();
    case 96:
      return BlocksPerSm<96>();
  }
  return BlocksPerSm<128>();
}

Status LaunchBatched(const AttendArgs& a, cudaStream_t stream) {
  switch (a.d) {
    case 32:
      return Launch<32>(a, stream);
    case 64:
      return Launch<64>(a, stream);
    case 96:
      return Launch<96>(a, stream);
    case 128:
      return Launch<128>(a, stream);
  }
  return Status(ErrorKind::kErr,
                "no batched tensor-core kernel for head dim " + std::to_string(a.d));
}

}  // namespace pion::kernels::cuda
