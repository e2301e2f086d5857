// pion-gpu-attn-bench: Pion's CUDA attention kernels alone (kernels/cuda/cuda_attention.h), timed
// with CUDA events as the mean per iteration over replays of a CUDA graph of 20 iterations
// after a warm-up ("us"; "us_launches": plain back-to-back launches), next to a plain
// streaming-read kernel over the same bytes in the same run (the bandwidth ceiling). The launch
// sequence per iteration is the one the GPU executor issues: split-K partials + combine (or, with
// one split, a launch that finishes itself), or block scores + block selection + sparse partials
// + combine (sparse-auto).
//
//   pion-gpu-attn-bench dense <f16|bf16|f32|f8> <H_q> <H_kv> <M> <N> <D>
//                       (f8: e4m3fn rows with an f32 scale each, kernels::MakeTensor's layout)
//                       (comparisons, same binary: PION_BENCH_SPLITS=<n> a split count,
//                       PION_BENCH_INTERLEAVE=0 decode warps on quarters, PION_BENCH_UNIFORM=0
//                       items loaded as for any grouping, PION_BENCH_F32TC=0 fp32 decode on
//                       the SIMT kernel, PION_BENCH_F8TC=0 fp8 decode on the SIMT kernel,
//                       PION_BENCH_BF16TC=0 bf16 decode on the SIMT kernel,
//                       PION_BENCH_STREAM=0 M = 1 decode on the tensor-core decode instead of
//                       the streaming decode, PION_BENCH_STREAM_TILE=64 its 64-key tiles for
//                       every shape, PION_BENCH_STREAM_BLOCKS=<n> its blocks a multiprocessor,
//                       PION_BENCH_STREAM_TEAMS=1|2 its teams of four warps a block (2 only
//                       where a ring holds under 64 KB),
//                       PION_BENCH_DUMP=<file> the output and LSEs as raw float32 (to compare
//                       two builds),
//                       PION_BENCH_OVERLAP=0 back-to-back calls without overlap,
//                       PION_BENCH_SKIP_COMBINE=1 the split-K
//                       launch alone, PION_BENCH_FINISH=1 the launch merging its own splits;
//                       M = 1 over a short range: the cluster decode's one launch where the
//                       executor takes it, with the split-K time beside it and the outputs
//                       compared — PION_BENCH_CLUSTER_DECODE=1 at any range it takes, =0
//                       never; PION_BENCH_CLUSTER_TILE=16|32 its keys a tile)
//   pion-gpu-attn-bench sparse_auto <f16|f32|f8> <H_q> <H_kv> <N> <D> <block> <K_top>
//   [shared|fused]
//                       (shared: SHARED selection — one block set per K/V head; fused: SHARED,
//                       and the one-launch kernel beside it, compared;
//                       PION_BENCH_CLUSTER=8|16 forces its cluster size,
//                       PION_BENCH_TRACE=1 adds its phases' mean times: queries, scores
//                       (block 0's warp 0), scores (all warps; every rank started), key
//                       exchange, cluster barrier, selection, compaction, first tiles
//                       requested, omitted mass, first tile landed (warp 0), attention, warp
//                       merge, cluster barrier, cluster merge, exit barrier)
//   pion-gpu-attn-bench stream <bytes> [sets]   (the best of gpu_stream.cu's forms; sets: read
//                       that many distinct buffers in turn)
//   Dense and stream: PION_BENCH_ROTATE=<R> / [sets] read R distinct copies in turn, as a model's
//   decode step reads one layer after another (no call served from the L2 the call before filled).
//   pion-gpu-attn-bench empty <kernels> <blocks>   (the launch floor: empty kernels per call)
//
// Prints one JSON object per line (us per call, bytes of K/V read, GB/s). Run by
// bench/bench_attend_gpu.py, which runs torch's scaled_dot_product_attention on the same shapes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "gpu_stream.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/gpu.h"

namespace {

using namespace pion;
using kernels::DType;
using kernels::cuda::AttendArgs;

void Ok(const Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    std::exit(1);
  }
}

uint32_t U(const char* s) { return static_cast<uint32_t>(std::strtoul(s, nullptr, 10)); }

template <typename T>
T* DevAlloc(size_t n) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

// n elements of device memory, on the host.
template <typename T>
std::vector<std::remove_cv_t<T>> Down(const T* p, size_t n) {
  std::vector<std::remove_cv_t<T>> h(n);
  CK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// The largest |x[i] − y[i]| (x and y the same length).
template <typename T>
double MaxAbsDiff(const std::vector<T>& x, const std::vector<T>& y) {
  double err = 0;
  for (size_t i = 0; i < x.size(); ++i) err = std::max(err, std::fabs(double(x[i]) - y[i]));
  return err;
}

// e4m3fn of x (|x| <= 448): the nearest of the 127 magnitudes, ties to the even code.
uint8_t ToE4m3(float x) {
  static const std::vector<float> mags = [] {
    std::vector<float> m(127);
    for (int c = 0; c < 127; ++c) {
      m[c] = (c >> 3) == 0 ? std::ldexp(float(c & 7), -9)
                           : std::ldexp(float(8 + (c & 7)), (c >> 3) - 10);
    }
    return m;
  }();
  const float a = std::fabs(x);
  const int hi = std::clamp<int>(
      static_cast<int>(std::lower_bound(mags.begin(), mags.end(), a) - mags.begin()), 1, 126);
  const float dl = a - mags[hi - 1], dh = mags[hi] - a;
  const int c = a >= 448.f ? 126 : (dh < dl || (dh == dl && hi % 2 == 0)) ? hi : hi - 1;
  return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | c);
}

// Random device values: fp32 normal-ish (sum of uniforms), or their fp16 bits, or (d: the row
// length) fp8 rows — e4m3 bytes, then a scale amax/448 per row.
void* RandomTensor(size_t elems, DType t, uint32_t seed, uint32_t d = 0) {
  std::vector<float> f(elems);
  uint64_t x = 0x9e3779b97f4a7c15ull * (seed + 1);
  for (auto& e : f) {
    float s = 0;
    for (int i = 0; i < 3; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      s += static_cast<float>(x >> 40) / static_cast<float>(1 << 24);
    }
    e = (s - 1.5f) * 2.0f;
  }
  void* dev = nullptr;
  if (t == DType::kFP8) {
    const size_t rows = elems / d;
    std::vector<uint8_t> h(elems + rows * 4);
    for (size_t r = 0; r < rows; ++r) {
      float amax = 0;
      for (uint32_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(f[r * d + j]));
      const float scale = amax / 448.f, inv = amax > 0 ? 448.f / amax : 0.f;
      for (uint32_t j = 0; j < d; ++j) h[r * d + j] = ToE4m3(f[r * d + j] * inv);
      std::memcpy(h.data() + elems + r * 4, &scale, 4);
    }
    CK(cudaMalloc(&dev, h.size()));
    CK(cudaMemcpy(dev, h.data(), h.size(), cudaMemcpyHostToDevice));
    return dev;
  }
  if (t == DType::kF32) {
    CK(cudaMalloc(&dev, elems * 4));
    CK(cudaMemcpy(dev, f.data(), elems * 4, cudaMemcpyHostToDevice));
  } else if (t == DType::kBF16) {
    std::vector<uint16_t> h(elems);
    for (size_t i = 0; i < elems; ++i) {  // bf16: the high half, rounded to nearest even
      uint32_t b;
      std::memcpy(&b, &f[i], 4);
      h[i] = static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
    CK(cudaMalloc(&dev, elems * 2));
    CK(cudaMemcpy(dev, h.data(), elems * 2, cudaMemcpyHostToDevice));
  } else {
    std::vector<uint16_t> h(elems);
    for (size_t i = 0; i < elems; ++i) {  // round-to-nearest fp16 of small normals
      uint32_t b;
      std::memcpy(&b, &f[i], 4);
      const uint32_t sign = (b >> 16) & 0x8000u;
      const int exp = static_cast<int>((b >> 23) & 0xff) - 127 + 15;
      uint32_t mant = b & 0x7fffffu;
      uint16_t out;
      if (exp <= 0) {
        out = static_cast<uint16_t>(sign);
      } else {
        uint32_t r = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
        if ((mant & 0x1fffu) > 0x1000u || ((mant & 0x1fffu) == 0x1000u && (r & 1))) ++r;
        out = static_cast<uint16_t>(sign | r);
      }
      h[i] = out;
    }
    CK(cudaMalloc(&dev, elems * 2));
    CK(cudaMemcpy(dev, h.data(), elems * 2, cudaMemcpyHostToDevice));
  }
  return dev;
}

// µs per call of `launch` (one iteration's launches), timed with events over `iters` calls
// after a warm-up. As METHOD.md advises for small launches, the calls are captured in a CUDA
// graph and its replays timed, so the host's launch rate does not set the number (a replay
// keeps the launches' programmatic dependencies); PION_BENCH_GRAPH=0 times plain back-to-back
// launches instead. *loop_us (optional) gets the plain-launch time as well.
template <typename F>
double TimeUs(cudaStream_t s, F&& launch, int iters, double* loop_us = nullptr,
              int per_graph = 20) {
  for (int i = 0; i < 5; ++i) launch();
  CK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto elapsed_us = [&](auto&& body, int calls) {
    CK(cudaEventRecord(a, s));
    body();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    return 1000.0 * ms / calls;
  };
  const double loop = elapsed_us(
      [&] {
        for (int i = 0; i < iters; ++i) launch();
      },
      iters);
  if (loop_us != nullptr) *loop_us = loop;
  const char* g = std::getenv("PION_BENCH_GRAPH");
  if (g != nullptr && g[0] == '0') return loop;
  const int kPerGraph = std::max(20, per_graph);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kPerGraph; ++i) launch();
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaGraphLaunch(exec, s));  // warm-up
  CK(cudaStreamSynchronize(s));
  const int replays = std::max(1, iters / kPerGraph);
  const double us = elapsed_us(
      [&] {
        for (int i = 0; i < replays; ++i) CK(cudaGraphLaunch(exec, s));
      },
      replays * kPerGraph);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  return us;
}

int Iters(double bytes) { return bytes > 1e9 ? 30 : bytes > 1e8 ? 100 : 400; }

// PION_BENCH_ROTATE=<R>: calls read R distinct copies of the K/V in turn (R >= 2), as a model's
// decode step reads layer after layer — no call finds the bytes the call before it read in L2.
// A graph then captures at least R calls. 0 or 1: every call reads the same K/V.
uint32_t RotateSets() {
  const char* r = std::getenv("PION_BENCH_ROTATE");
  return r == nullptr ? 1u : std::max(1u, U(r));
}

// `count` device copies of `bytes` at p (the first is p itself).
std::vector<const void*> Copies(const void* p, size_t bytes, uint32_t count) {
  std::vector<const void*> out{p};
  for (uint32_t i = 1; i < count; ++i) {
    void* c = DevAlloc<uint8_t>(bytes);
    CK(cudaMemcpy(c, p, bytes, cudaMemcpyDeviceToDevice));
    out.push_back(c);
  }
  return out;
}

struct Setup {
  AttendArgs a;
  std::vector<int32_t> map;
  std::vector<kernels::cuda::Item> items;
  float *pm, *pl, *po, *out, *lse;
  uint32_t parts = 0;
};

const char* TypeName(DType t) {
  return t == DType::kF16 ? "f16" : t == DType::kBF16 ? "bf16" : t == DType::kFP8 ? "f8" : "f32";
}

AttendArgs Base(DType t, uint32_t hq, uint32_t hkv, uint32_t m, uint32_t n, uint32_t d) {
  AttendArgs a;
  const size_t elems = size_t{hkv} * n * d;
  a.k = RandomTensor(elems, t, 1, d);
  a.v = RandomTensor(elems, t, 2, d);
  a.k_scale = kernels::MakeTensor(a.k, t, hkv, n, d).scales;
  a.v_scale = kernels::MakeTensor(a.v, t, hkv, n, d).scales;
  a.q = static_cast<float*>(RandomTensor(size_t{hq} * m * d, DType::kF32, 3));
  a.hq = hq;
  a.m = m;
  a.d = d;
  a.q_pos0 = n;
  a.dtype = t;
  a.heads = hkv;
  a.rows = n;
  a.begin = 0;
  a.end = n;
  a.scale = 1.0f / std::sqrt(static_cast<float>(d));
  a.nrows = hq * m;
  return a;
}

std::vector<int32_t> Contiguous(uint32_t hq, uint32_t hkv) {
  std::vector<int32_t> m(hq);
  for (uint32_t h = 0; h < hq; ++h) m[h] = static_cast<int32_t>(h / (hq / hkv));
  return m;
}

int Dense(DType t, uint32_t hq, uint32_t hkv, uint32_t m, uint32_t n, uint32_t d) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  AttendArgs a = Base(t, hq, hkv, m, n, d);
  auto map = Contiguous(hq, hkv);
  a.dense_items = true;
  if (const char* f = std::getenv("PION_BENCH_F32TC")) a.f32_tensor = f[0] == '1';
  if (const char* f = std::getenv("PION_BENCH_LOWP_BATCHED")) {
    kernels::cuda::SetLowpBatched(f[0] == '1');
  }
  if (const char* f = std::getenv("PION_BENCH_F8TC")) a.fp8_tensor = f[0] == '1';
  if (const char* f = std::getenv("PION_BENCH_BF16TC")) a.bf16_tensor = f[0] == '1';
  if (const char* f = std::getenv("PION_BENCH_STREAM")) a.stream_decode = f[0] == '1';
  if (const char* f = std::getenv("PION_BENCH_STREAM_TILE")) {
    kernels::cuda::SetStreamDecodeTile(U(f));
  }
  if (const char* f = std::getenv("PION_BENCH_STREAM_BLOCKS")) {
    kernels::cuda::SetStreamDecodeBlocks(U(f));
  }
  if (const char* f = std::getenv("PION_BENCH_STREAM_TEAMS")) {
    kernels::cuda::SetStreamDecodeTeams(U(f));
  }
  if (const char* f = std::getenv("PION_BENCH_OVERLAP"))
    kernels::cuda::SetOverlapCalls(f[0] == '1');
  bool tc = kernels::cuda::UsesTensorCores(a);
  const int pad = tc ? kernels::cuda::FlashRowGroups(a) : 1;
  auto items = kernels::cuda::DenseItems(hq, m, map.data(), pad);
  auto* di = DevAlloc<kernels::cuda::Item>(items.size());
  CK(cudaMemcpy(di, items.data(), items.size() * sizeof(items[0]), cudaMemcpyHostToDevice));
  a.items = di;
  a.n_items = static_cast<uint32_t>(items.size());
  a.item_rows = kernels::cuda::MaxRows(items);
  a.uniform_group = kernels::cuda::UniformGroup(items, m);
  tc = kernels::cuda::UsesTensorCores(a);  // fp32 decides on the items' rows
  a.splits = kernels::cuda::PlanSplits(a, n);
  // Comparisons: a split count, quarters instead of interleaved tiles (=0; head-wide: =2), the
  // items loaded as for any grouping (PION_BENCH_UNIFORM=0).
  if (const char* sp = std::getenv("PION_BENCH_SPLITS")) a.splits = U(sp);
  if (const char* tt = std::getenv("PION_BENCH_TENSOR")) a.tensor_tiles = tt[0] == '1';
  if (const char* il = std::getenv("PION_BENCH_INTERLEAVE"))
    a.interleave = static_cast<uint8_t>(il[0] - '0');
  if (const char* un = std::getenv("PION_BENCH_UNIFORM"); un != nullptr && un[0] == '0') {
    a.uniform_group = 0;
  }
  a.part_m = DevAlloc<float>(size_t{a.splits} * a.nrows);
  a.part_l = DevAlloc<float>(size_t{a.splits} * a.nrows);
  a.part_o = DevAlloc<float>(size_t{a.splits} * a.nrows * d);
  // The launch finishes itself (its last block per row group merges the splits), as the
  // executor runs it.
  a.out = DevAlloc<float>(size_t{a.nrows} * d);
  a.lse = DevAlloc<float>(a.nrows);
  // As the executor: one split finishes in the launch (PION_BENCH_FINISH=1: any split count,
  // to compare the in-launch merge with the combine kernel).
  const char* force = std::getenv("PION_BENCH_FINISH");
  if (a.splits == 1 || (force != nullptr && force[0] == '1')) {
    a.counters = DevAlloc<uint32_t>(kernels::cuda::GridBlocks(a));
    CK(cudaMemset(a.counters, 0, kernels::cuda::GridBlocks(a) * sizeof(uint32_t)));
  }
  const double bytes = 2.0 * kernels::TensorBytes(t, hkv, n, d);
  // A timing experiment: the split-K launch alone (its output is not merged).
  const char* nc = std::getenv("PION_BENCH_SKIP_COMBINE");
  const bool skip_combine = nc != nullptr && nc[0] == '1';
  // Distinct K/V sets read in turn (PION_BENCH_ROTATE), the same bytes each.
  const uint32_t sets = RotateSets();
  const size_t tensor_bytes = kernels::TensorBytes(t, hkv, n, d);
  const auto ks = Copies(a.k, tensor_bytes, sets), vs = Copies(a.v, tensor_bytes, sets);
  size_t turn = 0;
  double us_launches = 0;
  const double us = TimeUs(
      s,
      [&] {
        if (sets > 1) {
          const size_t i = turn++ % sets;
          a.k = ks[i];
          a.v = vs[i];
          a.k_scale = kernels::MakeTensor(a.k, t, hkv, n, d).scales;
          a.v_scale = kernels::MakeTensor(a.v, t, hkv, n, d).scales;
        }
        Ok(kernels::cuda::LaunchAttend(a, s));
        if (a.counters == nullptr && !skip_combine) {
          Ok(kernels::cuda::LaunchCombine(a.splits, a.nrows, d, a.part_m, a.part_l, a.part_o, a.out,
                                          a.lse, s));
        }
      },
      Iters(bytes), &us_launches, static_cast<int>(sets));
  // PION_BENCH_DUMP=<file>: the last call's output rows and LSEs as raw float32, to compare
  // two builds of a kernel on the same inputs (the inputs are a fixed sequence).
  if (const char* dump = std::getenv("PION_BENCH_DUMP")) {
    CK(cudaStreamSynchronize(s));
    const auto o = Down(a.out, size_t{a.nrows} * d);
    const auto l = Down(a.lse, a.nrows);
    FILE* f = std::fopen(dump, "wb");
    if (f == nullptr || std::fwrite(o.data(), 4, o.size(), f) != o.size() ||
        std::fwrite(l.data(), 4, l.size(), f) != l.size() || std::fclose(f) != 0) {
      std::fprintf(stderr, "PION_BENCH_DUMP: cannot write %s\n", dump);
      return 1;
    }
  }
  const char* path = !tc                                  ? "simt"
                     : pad >= 4                           ? "tensor-core batched"
                     : kernels::cuda::StreamDecodeFits(a) ? "streaming decode"
                                                          : "tensor-core decode";
  // M = 1 over a short range: the one launch of a cluster a K/V head (decode_cluster.cu), as the
  // executor takes it, timed beside the split-K launches above (PION_BENCH_CLUSTER_DECODE=1: at
  // any range it takes; =0: never), and its output checked against theirs.
  std::string cluster;
  double best = us, best_launches = us_launches;
  kernels::cuda::DecodeClusterArgs c;
  c.group = m == 1 ? kernels::cuda::GroupMembers(hq, map.data(), hkv, c.members) : 0;
  const char* cd = std::getenv("PION_BENCH_CLUSTER_DECODE");
  const bool can = c.group > 0 && kernels::cuda::DecodeClusterFits(t, d, c.group, hkv, 1);
  const bool take = cd != nullptr ? cd[0] == '1' && can
                                  : can && kernels::cuda::DecodeClusterFits(t, d, c.group, hkv, n);
  if (take && !skip_combine) {
    c.q = a.q;
    c.hq = hq;
    c.d = d;
    c.k = a.k;
    c.v = a.v;
    c.dtype = t;
    c.heads = hkv;
    c.rows = n;
    c.lo = 0;
    c.hi = n;
    c.scale = a.scale;
    c.out = DevAlloc<float>(size_t{a.nrows} * d);
    c.lse = DevAlloc<float>(a.nrows);
    if (const char* w = std::getenv("PION_BENCH_CLUSTER_TILE")) c.tile = U(w);
    double c_launches = 0;
    size_t c_turn = 0;
    const double c_us = TimeUs(
        s,
        [&] {
          if (sets > 1) {
            const size_t i = c_turn++ % sets;
            c.k = ks[i];
            c.v = vs[i];
          }
          Ok(kernels::cuda::LaunchDecodeCluster(c, s));
        },
        Iters(bytes), &c_launches, static_cast<int>(sets));
    CK(cudaStreamSynchronize(s));
    const size_t on = size_t{a.nrows} * d;
    const double err = std::max(MaxAbsDiff(Down(a.out, on), Down(c.out, on)),
                                MaxAbsDiff(Down(a.lse, a.nrows), Down(c.lse, a.nrows)));
    char buf[200];
    std::snprintf(buf, sizeof buf,
                  ", \"splitk_us\": %.2f, \"cluster_us\": %.2f, \"cluster_max_abs_diff\": %.2e", us,
                  c_us, err);
    cluster = buf;
    best = c_us;
    best_launches = c_launches;
    path = "cluster decode";
  }
  std::printf(
      "{\"kind\": \"dense\", \"dtype\": \"%s\", \"hq\": %u, \"hkv\": %u, \"m\": %u, \"n\": %u, "
      "\"d\": %u, \"us\": %.2f, \"us_launches\": %.2f, \"bytes\": %.0f, \"gbps\": %.1f, "
      "\"splits\": %u, \"tile\": %u, \"path\": \"%s\", \"sets\": %u%s}\n",
      TypeName(t), hq, hkv, m, n, d, best, best_launches, bytes, bytes / best / 1e3, a.splits,
      kernels::cuda::StreamDecodeFits(a) ? kernels::cuda::StreamDecodeTile(a) : 0u, path, sets,
      cluster.c_str());
  return 0;
}

int SparseAuto(DType t, uint32_t hq, uint32_t hkv, uint32_t n, uint32_t d, uint32_t block,
               uint32_t k_top, bool shared, bool fused) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  AttendArgs a = Base(t, hq, hkv, 1, n, d);
  auto map = Contiguous(hq, hkv);
  int32_t* dmap = DevAlloc<int32_t>(hq);
  CK(cudaMemcpy(dmap, map.data(), hq * 4, cudaMemcpyHostToDevice));
  const uint32_t nb = (n + block - 1) / block;
  const size_t ns = size_t{hkv} * nb * d;
  float* mean = DevAlloc<float>(ns);
  float* mn = DevAlloc<float>(ns);
  float* mx = DevAlloc<float>(ns);
  Ok(kernels::cuda::LaunchSummarize(a.k, t, a.k_scale, hkv, n, d, block, nb, mean, mn, mx, s));
  const uint32_t stride = std::min<uint32_t>((k_top + 2) * block, n);
  float* sel = DevAlloc<float>(size_t{hq} * nb);
  float* ms = DevAlloc<float>(size_t{hq} * nb);
  int32_t* blocks = DevAlloc<int32_t>(size_t{hq} * (k_top + 2));
  int32_t* nchosen = DevAlloc<int32_t>(hq);
  int32_t* list = DevAlloc<int32_t>(size_t{hq} * stride);
  int32_t* counts = DevAlloc<int32_t>(hq);
  float* omitted = DevAlloc<float>(hq);
  // As the executor: per-row lists on row items, or (shared) one list per K/V head's row group.
  auto items = shared ? kernels::cuda::DenseItems(hq, 1, map.data())
                      : kernels::cuda::RowItems(hq, 1, map.data());
  auto* di = DevAlloc<kernels::cuda::Item>(items.size());
  CK(cudaMemcpy(di, items.data(), items.size() * sizeof(items[0]), cudaMemcpyHostToDevice));
  a.items = di;
  a.n_items = static_cast<uint32_t>(items.size());
  a.item_rows = kernels::cuda::MaxRows(items);
  a.dense_items = shared;
  a.list = list;
  a.counts = counts;
  a.stride = stride;
  a.splits = kernels::cuda::PlanSplits(a, stride);
  a.part_m = DevAlloc<float>(size_t{a.splits} * hq);
  a.part_l = DevAlloc<float>(size_t{a.splits} * hq);
  a.part_o = DevAlloc<float>(size_t{a.splits} * hq * d);
  a.out = DevAlloc<float>(size_t{hq} * d);
  a.lse = DevAlloc<float>(hq);
  // K/V rows read: per query head, or per K/V head when shared (the worst case: no overlap).
  const double bytes = 2.0 * kernels::TensorBytes(t, shared ? hkv : hq, stride, d);
  // Distinct sets of K/V and block summaries read in turn (PION_BENCH_ROTATE), as a model's
  // decode step reads layer after layer: no call finds its summaries or rows in L2.
  const uint32_t sets = RotateSets();
  const size_t tensor_bytes = kernels::TensorBytes(t, hkv, n, d);
  const auto ks = Copies(a.k, tensor_bytes, sets), vs = Copies(a.v, tensor_bytes, sets);
  const auto means = Copies(mean, ns * sizeof(float), sets),
             mins = Copies(mn, ns * sizeof(float), sets),
             maxs = Copies(mx, ns * sizeof(float), sets);
  size_t turn = 0;
  const float *cur_mean = mean, *cur_min = mn, *cur_max = mx;
  // Points the launches at set i.
  auto use = [&](size_t i) {
    a.k = ks[i];
    a.v = vs[i];
    a.k_scale = kernels::MakeTensor(a.k, t, hkv, n, d).scales;
    a.v_scale = kernels::MakeTensor(a.v, t, hkv, n, d).scales;
    cur_mean = static_cast<const float*>(means[i]);
    cur_min = static_cast<const float*>(mins[i]);
    cur_max = static_cast<const float*>(maxs[i]);
  };
  auto next = [&] {
    if (sets > 1) use(turn++ % sets);
  };
  // The launch sequence, or its first `stages` launches (PION_BENCH_STAGES=1 times each
  // prefix: scores, select, attend, combine — the differences place the time).
  auto run = [&](int stages) {
    if (stages >= 1) {
      Ok(kernels::cuda::LaunchScoreBlocks(a.q, hq, d, dmap, cur_mean, cur_min, cur_max, nb,
                                          kernels::BlockSelector::kMean, sel, ms, s));
    }
    if (stages >= 2) {
      Ok(kernels::cuda::LaunchSelectBlocks(sel, ms, dmap, hq, shared, nb, block, 0, n, k_top,
                                           a.scale, blocks, nchosen, list, counts, stride, omitted,
                                           s));
    }
    if (stages >= 3) Ok(kernels::cuda::LaunchAttend(a, s));
    if (stages >= 4) {
      Ok(kernels::cuda::LaunchCombine(a.splits, hq, d, a.part_m, a.part_l, a.part_o, a.out, a.lse,
                                      s));
    }
  };
  double us_launches = 0;
  const double us = TimeUs(
      s,
      [&] {
        next();
        run(4);
      },
      200, &us_launches, static_cast<int>(sets));
  std::string stage_us;
  const char* stages = std::getenv("PION_BENCH_STAGES");
  if (stages != nullptr && stages[0] == '1') {
    for (int k = 1; k <= 4; ++k) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%s%.2f", k > 1 ? ", " : "",
                    TimeUs(
                        s,
                        [&] {
                          next();
                          run(k);
                        },
                        200, nullptr, static_cast<int>(sets)));
      stage_us += buf;
    }
  }
  // fused: the one-launch SHARED kernel beside the four launches, its results compared
  // with theirs (output, LSE, chosen blocks, counts, omitted mass).
  std::string fused_json;
  if (fused) {
    kernels::cuda::FusedSparseArgs f;
    if (kernels::cuda::GroupMembers(hq, map.data(), hkv, f.members) == 0) {
      std::fprintf(stderr, "fused: more than %d query heads per K/V head or %d K/V heads\n",
                   kernels::cuda::kMaxSharedGroup, kernels::cuda::kMaxFusedHeads);
      return 2;
    }
    f.q = a.q;
    f.hq = hq;
    f.d = d;
    f.k = a.k;
    f.v = a.v;
    f.heads = hkv;
    f.rows = n;
    f.mean = mean;
    f.min = mn;
    f.max = mx;
    f.nb = nb;
    f.block = block;
    f.lo = 0;
    f.hi = n;
    f.k_top = k_top;
    f.scale = a.scale;
    {
      const char* c = std::getenv("PION_BENCH_CLUSTER");
      f.cluster = kernels::cuda::SparseAutoSharedCluster(d, hkv, c ? U(c) : 0);
      const char* tt = std::getenv("PION_BENCH_TENSOR");
      if (tt != nullptr) f.tensor_tiles = tt[0] == '1';
    }
    f.out = DevAlloc<float>(size_t{hq} * d);
    f.lse = DevAlloc<float>(hq);
    f.blocks = DevAlloc<int32_t>(size_t{hq} * (k_top + 2));
    f.nchosen = DevAlloc<int32_t>(hq);
    f.counts = DevAlloc<int32_t>(hq);
    f.omitted = DevAlloc<float>(hq);
    // The one launch reads the set the four launches read.
    auto fuse_set = [&] {
      f.k = a.k;
      f.v = a.v;
      f.mean = cur_mean;
      f.min = cur_min;
      f.max = cur_max;
    };
    use(0);
    fuse_set();
    run(4);
    Ok(kernels::cuda::LaunchSparseAutoShared(f, s));
    CK(cudaStreamSynchronize(s));
    const auto b1 = Down(blocks, size_t{hq} * (k_top + 2)),
               b2 = Down(f.blocks, size_t{hq} * (k_top + 2));
    const auto n1 = Down(nchosen, hq), n2 = Down(f.nchosen, hq);
    const auto c1 = Down(counts, hq), c2 = Down(f.counts, hq);
    const double err =
        std::max(MaxAbsDiff(Down(a.out, size_t{hq} * d), Down(f.out, size_t{hq} * d)),
                 MaxAbsDiff(Down(a.lse, hq), Down(f.lse, hq)));
    const double om_err = MaxAbsDiff(Down(omitted, hq), Down(f.omitted, hq));
    bool same = n1 == n2 && c1 == c2;
    for (uint32_t h = 0; same && h < hq; ++h) {
      for (int32_t j = 0; j < n1[h]; ++j)
        same = same && b1[h * (k_top + 2) + j] == b2[h * (k_top + 2) + j];
    }
    double fused_launches = 0;
    const double fused_us = TimeUs(
        s,
        [&] {
          next();
          fuse_set();
          Ok(kernels::cuda::LaunchSparseAutoShared(f, s));
        },
        200, &fused_launches, static_cast<int>(sets));
    // PION_BENCH_TRACE=1: one more launch with clock64 marks at the phase boundaries, each
    // phase's mean over the blocks in µs (at the SM clock the device reports).
    std::string phases;
    if (const char* tr = std::getenv("PION_BENCH_TRACE"); tr != nullptr && tr[0] == '1') {
      constexpr int kMarks = kernels::cuda::kFusedTraceMarks;
      const size_t blocks_n = size_t{hkv} * f.cluster;
      f.trace = DevAlloc<long long>(blocks_n * kMarks);
      Ok(kernels::cuda::LaunchSparseAutoShared(f, s));
      CK(cudaStreamSynchronize(s));
      const auto tr_h = Down(f.trace, blocks_n * kMarks);
      int khz = 0;
      CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
      for (int i = 1; i < kMarks; ++i) {
        double sum = 0;
        for (size_t b = 0; b < blocks_n; ++b) {
          sum += double(tr_h[b * kMarks + i] - tr_h[b * kMarks + i - 1]);
        }
        const double cycles = sum / double(blocks_n);
        char p[32];
        std::snprintf(p, sizeof p, "%s%.2f", i > 1 ? ", " : "", cycles / khz * 1e3);
        phases += p;
      }
      f.trace = nullptr;
    }
    std::string active;
    for (uint32_t c : {8u, 16u}) {
      active += (active.empty() ? "\"" : ", \"") + std::to_string(c) +
                "\": " + std::to_string(kernels::cuda::SparseAutoSharedActiveClusters(d, c));
    }
    char buf[768];
    std::snprintf(buf, sizeof buf,
                  ", \"fused_us\": %.2f, \"fused_us_launches\": %.2f, \"fused_cluster\": %u, "
                  "\"fused_max_abs_err\": %.3g, \"fused_omitted_err\": %.3g, "
                  "\"fused_same_blocks\": %s, \"fused_phase_us\": [%s], "
                  "\"fused_active_clusters\": {%s}",
                  fused_us, fused_launches, f.cluster, err, om_err, same ? "true" : "false",
                  phases.c_str(), active.c_str());
    fused_json = buf;
  }
  std::printf(
      "{\"kind\": \"sparse_auto\", \"dtype\": \"%s\", \"hq\": %u, \"hkv\": %u, \"m\": 1, \"n\": "
      "%u, \"d\": %u, \"block\": %u, \"k_top\": %u, \"budget\": %u, \"us\": %.2f, "
      "\"us_launches\": %.2f, \"bytes\": %.0f, \"splits\": %u, \"shared\": %s, \"path\": \"%s\", "
      "\"sets\": %u, \"stage_us\": [%s]%s}\n",
      TypeName(t), hq, hkv, n, d, block, k_top, stride, us, us_launches, bytes, a.splits,
      shared ? "true" : "false", kernels::cuda::UsesTensorCores(a) ? "tensor-core" : "simt", sets,
      stage_us.c_str(), fused_json.c_str());
  return 0;
}

// The plain streaming read of `bytes`, from `sets` distinct buffers in turn (as Dense reads its
// rotated K/V), in every form of gpu_stream.cu: the best is the ceiling ("us", "gbps"), each
// form's beside it.
int Stream(size_t bytes, uint32_t sets) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<void*> bufs;
  for (uint32_t i = 0; i < std::max(1u, sets); ++i) {
    bufs.push_back(DevAlloc<uint8_t>(bytes));
    CK(cudaMemset(bufs.back(), 1 + i, bytes));
  }
  uint32_t* sink = DevAlloc<uint32_t>(1 << 16);
  const int sms = gpu::Info().sms;
  double best = 0;
  int best_kind = 0;
  std::string each;
  for (int kind = 0; kind < kStreamKinds; ++kind) {
    size_t turn = 0;
    const double us = TimeUs(
        s, [&] { LaunchStreamRead(bufs[turn++ % bufs.size()], bytes, sink, sms, s, kind); },
        Iters(bytes), nullptr, static_cast<int>(bufs.size()));
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s%.2f", kind ? ", " : "", us);
    each += buf;
    if (best == 0 || us < best) {
      best = us;
      best_kind = kind;
    }
  }
  std::printf(
      "{\"kind\": \"stream\", \"bytes\": %zu, \"sets\": %zu, \"us\": %.2f, \"gbps\": %.1f, "
      "\"best_form\": %d, \"us_by_form\": [%s]}\n",
      bytes, bufs.size(), best, bytes / best / 1e3, best_kind, each.c_str());
  return 0;
}

// Launches of `kernels` empty kernels per call: the floor under any sequence of that many launches.
int Empty(uint32_t kernels, uint32_t blocks) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double us_launches = 0;
  const double us = TimeUs(
      s,
      [&] {
        for (uint32_t i = 0; i < kernels; ++i) LaunchEmpty(static_cast<int>(blocks), s);
      },
      400, &us_launches);
  std::printf(
      "{\"kind\": \"empty\", \"kernels\": %u, \"blocks\": %u, \"us\": %.2f, "
      "\"us_launches\": %.2f}\n",
      kernels, blocks, us, us_launches);
  return 0;
}

DType ParseType(const char* s) {
  if (std::strcmp(s, "f8") == 0) return DType::kFP8;
  if (std::strcmp(s, "bf16") == 0) return DType::kBF16;
  return std::strcmp(s, "f16") == 0 ? DType::kF16 : DType::kF32;
}

}  // namespace

int main(int argc, char** argv) {
  if (!gpu::Info().present) {
    std::fprintf(stderr, "no CUDA device: %s\n", gpu::Info().reason.c_str());
    return 2;
  }
  const std::string kind = argc > 1 ? argv[1] : "";
  if (kind == "dense" && argc == 8) {
    return Dense(ParseType(argv[2]), U(argv[3]), U(argv[4]), U(argv[5]), U(argv[6]), U(argv[7]));
  }
  const std::string mode = argc == 10 ? argv[9] : "";
  if (kind == "sparse_auto" && (argc == 9 || mode == "shared" || mode == "fused")) {
    return SparseAuto(ParseType(argv[2]), U(argv[3]), U(argv[4]), U(argv[5]), U(argv[6]),
                      U(argv[7]), U(argv[8]), argc == 10, mode == "fused");
  }
  if (kind == "stream" && (argc == 3 || argc == 4)) {
    return Stream(std::strtoull(argv[2], nullptr, 10), argc == 4 ? U(argv[3]) : 1u);
  }
  if (kind == "empty" && argc == 4) return Empty(U(argv[2]), U(argv[3]));
  std::fprintf(stderr,
               "usage: pion-gpu-attn-bench dense <f16|bf16|f32|f8> <H_q> <H_kv> <M> <N> <D>\n"
               "       pion-gpu-attn-bench sparse_auto <f16|f32|f8> <H_q> <H_kv> <N> <D> <block> "
               "<K_top> [shared|fused]\n"
               "       pion-gpu-attn-bench stream <bytes> [sets]\n"
               "       pion-gpu-attn-bench empty <kernels> <blocks>\n");
  return 2;
}
