// pion-codec-bench: encode and decode throughput of every value codec (src/store/codec).
//
// One batch = 4096 rows of dim 1024 (8 KV heads x 128), Gaussian values, encoded or decoded with
// one RowCodec::Encode/Decode call on one thread. Throughput is reported in fp32 bytes per second
// (16 MiB per batch, the same for every format, so the numbers compare directly), next to a peer
// measured in the same run: memcpy of the same 16 MiB (BM_Memcpy), which is the fp32 codec's
// cost and the ceiling for any format that touches every fp32 byte once. The `rows:64` variants
// (256 KiB, L2-resident) show the compute rate without the trip to memory.
//
// Each benchmark runs 5 repetitions and prints mean/median/stddev/cv; the median is the figure
// (--benchmark_out=FILE.json also keeps every repetition, e.g. for a best-of on a busy machine).
//   build/pion-codec-bench                                  # all
//   build/pion-codec-bench --benchmark_filter=turbo         # a subset
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "store/codec/codec.h"

namespace {

constexpr uint32_t kDim = 1024;
constexpr size_t kRows = 4096;
constexpr size_t kFp32Bytes = kRows * kDim * sizeof(float);
constexpr size_t kCacheRows = 64;

const std::vector<float>& Input() {
  static const std::vector<float> x = [] {
    std::vector<float> v(kRows * kDim);
    std::mt19937_64 rng(2026);
    std::normal_distribution<float> gauss;
    for (float& f : v) f = gauss(rng);
    return v;
  }();
  return x;
}

pion::codec::RowCodec MakeCodec(pion::codec::Format f) {
  auto c = pion::codec::RowCodec::Create(f, kDim);
  if (!c.ok()) std::abort();  // fixed, valid arguments
  return std::move(c).value();
}

void SetCounters(benchmark::State& state, const pion::codec::RowCodec& c, size_t rows) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * rows * kDim * sizeof(float)));
  state.counters["row_bytes"] = static_cast<double>(c.row_bytes());
  state.counters["ratio"] = static_cast<double>(kDim * sizeof(float)) / c.row_bytes();
}

void BM_Encode(benchmark::State& state, pion::codec::Format f, size_t rows) {
  const pion::codec::RowCodec c = MakeCodec(f);
  const std::vector<float>& x = Input();
  std::vector<uint8_t> out(rows * c.row_bytes());
  for (auto _ : state) {
    c.Encode(x.data(), rows, out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  SetCounters(state, c, rows);
}

void BM_Decode(benchmark::State& state, pion::codec::Format f, size_t rows) {
  const pion::codec::RowCodec c = MakeCodec(f);
  std::vector<uint8_t> enc(rows * c.row_bytes());
  c.Encode(Input().data(), rows, enc.data());
  std::vector<float> out(rows * kDim);
  for (auto _ : state) {
    c.Decode(enc.data(), rows, out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  SetCounters(state, c, rows);
}

void BM_Memcpy(benchmark::State& state) {
  const std::vector<float>& x = Input();
  std::vector<float> out(x.size());
  for (auto _ : state) {
    std::memcpy(out.data(), x.data(), kFp32Bytes);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kFp32Bytes));
}

void Register() {
  auto configure = [](benchmark::internal::Benchmark* b) {
    b->Unit(benchmark::kMillisecond)->MinTime(0.2)->Repetitions(5)->DisplayAggregatesOnly(true);
  };
  configure(benchmark::RegisterBenchmark("memcpy_16MiB", BM_Memcpy));
  using pion::codec::Format;
  for (Format f : {Format::kFp32, Format::kFp16, Format::kBf16, Format::kInt8, Format::kFp8,
                   Format::kFp8E5m2, Format::kTurbo4, Format::kTurbo3, Format::kTurbo2}) {
    for (size_t rows : {kRows, kCacheRows}) {
      const std::string name =
          std::string(pion::codec::FormatName(f)) + "/rows:" + std::to_string(rows);
      configure(benchmark::RegisterBenchmark(("encode/" + name).c_str(), BM_Encode, f, rows));
      configure(benchmark::RegisterBenchmark(("decode/" + name).c_str(), BM_Decode, f, rows));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Register();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
