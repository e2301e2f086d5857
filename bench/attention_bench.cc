// pion-attn-bench: speed of the CPU attention kernels (src/kernels) next to peers measured in the
// same run: the machine's single-thread read bandwidth (a STREAM-style sum over a 1 GiB array)
// and the scalar reference kernels.
//
// Decode (M=1) is memory-bound: the figure is the effective read rate, (K+V bytes)/time, and its
// ratio to the measured read bandwidth. "cold" cycles through enough copies of K/V (>= 1.5 GiB in
// all) that every call reads from DRAM; "warm" repeats one copy (cache-resident when it fits).
// Prefill-like shapes (M=64, 512) are compute-bound and report GFLOP/s (4·hq·M·N·D).
// Every figure is the median of the timed calls (min in brackets for the bandwidth peer).
//   build-kernels/pion-attn-bench            # everything (~1.5 min)
//   build-kernels/pion-attn-bench --quick    # fewer shapes and repetitions
#include <hwy/targets.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/attention.h"

namespace {

using pion::kernels::AttentionKernels;
using pion::kernels::DType;
using pion::kernels::Keys;
using pion::kernels::Partial;
using pion::kernels::Queries;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Sixteen independent partial sums so the compiler vectorizes without reassociating.
float SumRange(const float* x, size_t n) {
  float acc[16] = {};
  for (size_t i = 0; i + 16 <= n; i += 16) {
    for (int k = 0; k < 16; ++k) acc[k] += x[i + k];
  }
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

struct Bandwidth {
  double best, median;
};

// Read bandwidth in GB/s of `threads` threads summing disjoint halves of a 1 GiB array.
Bandwidth MeasureReadBandwidth(const float* x, size_t n, int threads, int reps) {
  std::vector<double> gbs;
  volatile float sink = 0;
  for (int r = 0; r < reps; ++r) {
    std::vector<float> partial(threads);
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const size_t chunk = n / threads;
        partial[t] = SumRange(x + t * chunk, chunk);
      });
    }
    for (auto& th : pool) th.join();
    const auto t1 = Clock::now();
    for (float p : partial) sink = sink + p;
    gbs.push_back(n * sizeof(float) / Seconds(t0, t1) / 1e9);
  }
  return {*std::max_element(gbs.begin(), gbs.end()), Median(gbs)};
}

// Fills the arena with random values: fp32 in (-1, 1), or fp16 bit patterns in ±[2^-6, 2).
void FillRandom(uint8_t* p, size_t bytes, DType dtype) {
  uint64_t s = 0x9E3779B97F4A7C15ull;
  auto* w = reinterpret_cast<uint32_t*>(p);
  for (size_t i = 0; i < bytes / 4; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t r = static_cast<uint32_t>(s >> 32);
    if (dtype == DType::kF32) {
      const float f = static_cast<float>(r >> 8) * 0x1p-23f - 1.0f;
      std::memcpy(&w[i], &f, 4);
    } else {
      const uint32_t h0 = (r & 0x83FFu) | ((9 + (r >> 10) % 7) << 10);
      const uint32_t h1 = ((r >> 16) & 0x83FFu) | ((9 + (r >> 26) % 7) << 10);
      w[i] = (h1 << 16) | h0;
    }
  }
}

struct Arena {
  uint8_t* base = nullptr;
  size_t bytes = 0;
};

struct Shape {
  uint32_t heads = 8, group = 1, m = 1, n = 0, d = 128;
  DType dtype = DType::kF32;
};

struct Timing {
  double median_s = 0;  // per call
  size_t kv_bytes = 0;  // K + V bytes read per call
  double flops = 0;     // 4 · hq · m · n · d
  int copies = 0;
};

// Times kernels.Attend on `shape`, cycling through as many copies of K/V as fit in the arena
// (cold) or one copy (warm).
Timing TimeAttend(const AttentionKernels& kernels, const Shape& sh, const Arena& arena, bool cold,
                  double budget_s, int max_reps) {
  const uint32_t hq = sh.heads * sh.group;
  const size_t elems = static_cast<size_t>(sh.heads) * sh.n * sh.d;
  const size_t tensor_bytes = elems * pion::kernels::DTypeSize(sh.dtype);
  const size_t copy_bytes = 2 * tensor_bytes;
  const int copies = cold ? static_cast<int>(std::max<size_t>(1, arena.bytes / copy_bytes)) : 1;

  std::vector<float> q(static_cast<size_t>(hq) * sh.m * sh.d);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * static_cast<float>(i));
  std::vector<int32_t> head_map(hq);
  for (uint32_t h = 0; h < hq; ++h) head_map[h] = static_cast<int32_t>(h / sh.group);
  const size_t rows = static_cast<size_t>(hq) * sh.m;
  std::vector<float> m(rows), l(rows), o(rows * sh.d);
  Partial out{m.data(), l.data(), o.data(), rows, sh.d};
  Queries queries{q.data(), hq, sh.m, sh.d, head_map.data(), static_cast<int64_t>(sh.n)};
  const float scale = 1.0f / std::sqrt(static_cast<float>(sh.d));

  auto keys_of = [&](int c) {
    Keys keys;
    const uint8_t* kv = arena.base + static_cast<size_t>(c) * copy_bytes;
    keys.k = {kv, sh.dtype, sh.heads, sh.n, sh.d};
    keys.v = {kv + tensor_bytes, sh.dtype, sh.heads, sh.n, sh.d};
    keys.begin = 0;
    keys.end = sh.n;
    return keys;
  };
  // One untimed call (page faults, thread_local scratch), then reps.
  kernels.Attend(queries, keys_of(0), scale, 0, out);
  std::vector<double> times;
  const auto start = Clock::now();
  for (int r = 0; r < max_reps; ++r) {
    const Keys keys = keys_of(cold ? (r + 1) % copies : 0);
    const auto t0 = Clock::now();
    kernels.Attend(queries, keys, scale, 0, out);
    const auto t1 = Clock::now();
    times.push_back(Seconds(t0, t1));
    if (r >= 4 && Seconds(start, t1) > budget_s) break;
  }
  Timing t;
  t.median_s = Median(times);
  t.kv_bytes = copy_bytes;
  t.flops = 4.0 * hq * sh.m * static_cast<double>(sh.n) * sh.d;
  t.copies = copies;
  return t;
}

std::string SizeName(uint32_t n) {
  return n % 1024 == 0 ? std::to_string(n / 1024) + "K" : std::to_string(n);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  bool bandwidth = true;
  std::string filter;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--no-bandwidth") == 0) {
      bandwidth = false;
    } else if (std::strcmp(argv[i], "--filter") == 0 && i + 1 < argc) {
      filter = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--no-bandwidth] [--filter SUBSTRING]\n"
                   "  --filter keeps the rows whose label (e.g. 'decode fp16 G=4 N=32K cold',\n"
                   "  'prefill fp32 M=64', 'ref fp32 G=1 M=1 N=2K') contains SUBSTRING\n",
                   argv[0]);
      return 2;
    }
  }
  auto keep = [&](const std::string& label) {
    return filter.empty() || label.find(filter) != std::string::npos;
  };
  const auto& cpu = pion::kernels::CpuKernels();
  const auto& ref = pion::kernels::ReferenceKernels();
  std::printf("pion-attn-bench: Highway dispatch target %s, %u hardware threads%s\n",
              hwy::TargetName(hwy::SupportedTargets() & -hwy::SupportedTargets()),
              std::thread::hardware_concurrency(), quick ? ", --quick" : "");

  // Arena for K/V copies; also the 1 GiB array of the bandwidth peer.
  Arena arena;
  arena.bytes = quick ? (size_t{1} << 30) : (size_t{3} << 29);  // 1 or 1.5 GiB
  std::unique_ptr<uint8_t[]> storage(new uint8_t[arena.bytes + 4096]);
  arena.base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.get()) + 4095) &
                                          ~uintptr_t{4095});
  FillRandom(arena.base, arena.bytes, DType::kF32);

  // (a) read bandwidth
  const size_t gib_floats = (size_t{1} << 30) / sizeof(float);
  const int bw_reps = quick ? 5 : 9;
  Bandwidth bw1{1, 1}, bw2{1, 1};
  if (bandwidth) {
    bw1 = MeasureReadBandwidth(reinterpret_cast<const float*>(arena.base), gib_floats, 1, bw_reps);
    bw2 = MeasureReadBandwidth(reinterpret_cast<const float*>(arena.base), gib_floats, 2, bw_reps);
  }
  std::printf("\n## Read bandwidth (sum over 1 GiB fp32, %d reps)\n\n", bw_reps);
  std::printf("| threads | median GB/s | best GB/s |\n|---|---|---|\n");
  std::printf("| 1 | %.1f | %.1f |\n| 2 | %.1f | %.1f |\n", bw1.median, bw1.best, bw2.median,
              bw2.best);

  const double budget = quick ? 0.3 : 1.0;
  // (b) decode
  std::printf(
      "\n## Decode: CpuKernels().Attend, M=1, H_kv=8, D=128 (ratio = effective GB/s / "
      "1-thread median read GB/s %.1f)\n\n",
      bw1.median);
  std::printf(
      "| dtype | G | N | K+V MiB | cache | copies | us/call | GB/s | ratio |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  std::vector<uint32_t> ns =
      quick ? std::vector<uint32_t>{2048, 32768} : std::vector<uint32_t>{2048, 8192, 32768, 131072};
  for (DType dt : {DType::kF32, DType::kF16}) {
    FillRandom(arena.base, arena.bytes, dt);
    for (uint32_t group : {1u, 4u, 8u}) {
      for (uint32_t n : ns) {
        Shape sh;
        sh.group = group;
        sh.n = n;
        sh.dtype = dt;
        for (bool cold : {true, false}) {
          if (!keep(std::string("decode ") + std::string(pion::kernels::DTypeName(dt)) + " G=" +
                    std::to_string(group) + " N=" + SizeName(n) + (cold ? " cold" : " warm"))) {
            continue;
          }
          const Timing t = TimeAttend(cpu, sh, arena, cold, budget, 2000);
          const double gbs = t.kv_bytes / t.median_s / 1e9;
          std::printf("| %s | %u | %s | %.0f | %s | %d | %.1f | %.1f | %.2f |\n",
                      std::string(pion::kernels::DTypeName(dt)).c_str(), group, SizeName(n).c_str(),
                      t.kv_bytes / 1048576.0, cold ? "cold" : "warm", t.copies, t.median_s * 1e6,
                      gbs, gbs / bw1.median);
        }
      }
    }
  }

  // Prefill-like: many query rows per K/V head.
  std::printf("\n## Many query rows: CpuKernels().Attend, H_kv=8, D=128, N=8K, cold\n\n");
  std::printf("| dtype | G | M | ms/call | GFLOP/s |\n|---|---|---|---|---|\n");
  for (DType dt : {DType::kF32, DType::kF16}) {
    FillRandom(arena.base, arena.bytes, dt);
    for (uint32_t mq : {64u, 512u}) {
      if (quick && mq == 512 && dt == DType::kF16) continue;
      if (!keep("prefill " + std::string(pion::kernels::DTypeName(dt)) +
                " M=" + std::to_string(mq))) {
        continue;
      }
      Shape sh;
      sh.m = mq;
      sh.n = 8192;
      sh.dtype = dt;
      const Timing t = TimeAttend(cpu, sh, arena, true, budget, 50);
      std::printf("| %s | 1 | %u | %.2f | %.1f |\n",
                  std::string(pion::kernels::DTypeName(dt)).c_str(), mq, t.median_s * 1e3,
                  t.flops / t.median_s / 1e9);
    }
  }

  // (c) against the scalar reference, same shapes
  std::printf("\n## Against the scalar reference (D=128, H_kv=8, warm)\n\n");
  std::printf("| shape | reference ms | cpu ms | speedup |\n|---|---|---|---|\n");
  struct RefCase {
    uint32_t group, m, n;
    DType dt;
  };
  const RefCase ref_cases[] = {
      {1, 1, 2048, DType::kF32}, {4, 1, 2048, DType::kF16}, {1, 64, 512, DType::kF32}};
  for (const RefCase& c : ref_cases) {
    if (!keep("ref " + std::string(pion::kernels::DTypeName(c.dt)) + " G=" +
              std::to_string(c.group) + " M=" + std::to_string(c.m) + " N=" + SizeName(c.n))) {
      continue;
    }
    FillRandom(arena.base, size_t{64} << 20, c.dt);  // the one warm copy
    Shape sh;
    sh.group = c.group;
    sh.m = c.m;
    sh.n = c.n;
    sh.dtype = c.dt;
    const Timing tr = TimeAttend(ref, sh, arena, false, quick ? 0.5 : 1.5, 5);
    const Timing tc = TimeAttend(cpu, sh, arena, false, budget, 200);
    std::printf("| %s G=%u M=%u N=%s | %.2f | %.3f | %.0fx |\n",
                std::string(pion::kernels::DTypeName(c.dt)).c_str(), c.group, c.m,
                SizeName(c.n).c_str(), tr.median_s * 1e3, tc.median_s * 1e3,
                tr.median_s / tc.median_s);
  }
  return 0;
}
