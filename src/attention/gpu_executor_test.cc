// The CUDA backend against the scalar reference: every form (dense, top_k, fused, caller
// sparse, sparse-auto with mean and Quest, sparse-auto fused) over fp32 and fp16 slots, every
// head dim, GQA, M = 1 and batched, windows and query positions — outputs, LSE and receipts.
// Also: the GPU tier of the residency engine (promotion, demotion of unpinned replicas only,
// pins). Skips without a CUDA device.
//
// Tolerances, err = |gpu − ref| / (1 + |ref|), ref = ReferenceKernels (double) over the same
// stored values (fp16 slots: the reference reads the same fp16 K/V):
//   fp32 slots, and fp16 and bf16 slots on the decode path (Q and P split
//   hi+lo: bf16's two parts keep 16 significand bits)                      1e-4
//   fp16 slots, batched tensor-core path (Q and P as fp16)               4e-3
// fp8 slots (e4m3 bytes and row scales) take the fp32 tolerance against the reference over the
// same stored rows (e4m3 × scale), and against the reference over the fp32 rows they were
// encoded from, the output's relative MSE stays within the documented fp8 bound (4e-3) and
// above a floor (3e-4: a kernel that read more than the fp8 bytes would be too exact).
// Receipts (rows attended, support, chosen blocks, exactness) must match exactly; omitted-mass
// estimates within 1e-4.
#include "attention/gpu_executor.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <future>
#include <random>
#include <tuple>
#include <vector>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/gpu.h"
#include "residency/engine.h"
#include "store/codec/codec_internal.h"

namespace pion::attention {
namespace {

using kernels::DType;

#define SKIP_WITHOUT_GPU()  \
  if (!gpu::Info().present) \
  GTEST_SKIP() << "no CUDA device (" << gpu::Info().reason << "): GPU tests run on the GPU machine"

std::vector<float> Randn(size_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> g(0.f, scale);
  std::vector<float> x(n);
  for (auto& e : x) e = g(rng);
  return x;
}

// A slot in both places: host bytes (for the reference) and its GPU copy.
struct TestSlot {
  Slot slot;
  std::vector<uint8_t> k, v;
  std::vector<float> k32, v32;  // fp8: the fp32 rows encoded
  residency::GpuPin pin;        // the slot's GPU replica, held for the test
  kernels::Tensor3 K() const {
    return kernels::MakeTensor(k.data(), slot.dtype, slot.heads, slot.rows, slot.d);
  }
  kernels::Tensor3 V() const {
    return kernels::MakeTensor(v.data(), slot.dtype, slot.heads, slot.rows, slot.d);
  }
  kernels::Tensor3 K32() const {
    return kernels::MakeTensor(k32.data(), DType::kF32, slot.heads, slot.rows, slot.d);
  }
  kernels::Tensor3 V32() const {
    return kernels::MakeTensor(v32.data(), DType::kF32, slot.heads, slot.rows, slot.d);
  }
};

// An engine with a GPU tier whose copies run inline (the test thread does the uploads).
std::unique_ptr<residency::Engine> MakeEngine(uint64_t gpu_limit) {
  residency::EngineOptions o;
  o.gpu_limit = gpu_limit;
  o.run_gpu = [](std::function<void()> job) {
    job();
    return true;
  };
  return std::make_unique<residency::Engine>(std::move(o));
}

residency::Engine& Engine() {
  static auto e = MakeEngine(8ull << 30);
  return *e;
}

// Require() on one object, waited for.
Status RequireGpu(residency::Engine& e, const residency::ObjectRef& obj) {
  std::promise<Status> p;
  e.Require({obj}, residency::Tier::kGpu, residency::kNoDeadline,
            [&](const Status& s, residency::PinSet) { p.set_value(s); });
  return p.get_future().get();
}

residency::ObjectRef HostObject(residency::Engine& e, const std::vector<uint8_t>& k,
                                const std::vector<uint8_t>& v) {
  auto kb = CopyToBuffer({reinterpret_cast<const char*>(k.data()), k.size()}).value();
  auto vb = CopyToBuffer({reinterpret_cast<const char*>(v.data()), v.size()}).value();
  return e.CreateInHost(residency::Family::kAttention, {kb, vb}, nullptr);
}

// How a test slot's keys are laid out: random, or made so that block scores tie or crowd.
enum class Keys {
  kRandom,
  kRepeat,   // block b's keys are block b % 3's: three distinct block scores, many ties
  kOutlier,  // keys × 0.1, block 1's + 60: one block score far from the rest, which crowd
};

// poison_from >= 0: every head's rows from there on hold NaN in K and V (rows no query sees:
// a kernel that lets them into its sums, even times a zero weight, returns NaN).
std::unique_ptr<TestSlot> MakeSlot(uint32_t heads, uint32_t rows, uint32_t d, DType dtype,
                                   std::mt19937& rng, Keys keys = Keys::kRandom, uint32_t block = 0,
                                   int64_t poison_from = -1) {
  auto t = std::make_unique<TestSlot>();
  t->slot.heads = heads;
  t->slot.rows = rows;
  t->slot.d = d;
  t->slot.dtype = dtype;
  const size_t elems = size_t{heads} * rows * d;
  for (auto* dst : {&t->k, &t->v}) {
    auto src = Randn(elems, rng);
    if (dst == &t->k && keys != Keys::kRandom) {
      for (size_t i = 0; i < elems; ++i) {
        const size_t head = i / (size_t{rows} * d), row = i / d % rows, col = i % d;
        const size_t b = row / block;
        if (keys == Keys::kRepeat) {
          if (b >= 3) src[i] = src[(head * rows + (b % 3) * block + row % block) * d + col];
        } else {
          src[i] = src[i] * 0.1f + (b == 1 ? 60.f : 0.f);
        }
      }
    }
    dst->resize(kernels::TensorBytes(dtype, heads, rows, d));
    if (dtype == DType::kFP8) {  // the codec's rows [scale][d e4m3], split into bytes and scales
      std::vector<uint8_t> coded(size_t{heads} * rows * (d + 4));
      codec::internal::EncodeFp8(src.data(), size_t{heads} * rows, d, coded.data());
      for (size_t r = 0; r < size_t{heads} * rows; ++r) {
        std::memcpy(dst->data() + r * d, coded.data() + r * (d + 4) + 4, d);
        std::memcpy(dst->data() + elems + r * 4, coded.data() + r * (d + 4), 4);
      }
      (dst == &t->k ? t->k32 : t->v32) = src;
    } else if (dtype == DType::kF32) {
      std::memcpy(dst->data(), src.data(), elems * 4);
    } else if (dtype == DType::kBF16) {  // truncated: any bf16 pattern will do
      auto* h = reinterpret_cast<uint16_t*>(dst->data());
      for (size_t i = 0; i < elems; ++i)
        h[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(src[i]) >> 16);
    } else {
      auto* h = reinterpret_cast<uint16_t*>(dst->data());
      for (size_t i = 0; i < elems; ++i) h[i] = codec::internal::F32ToF16Bits(src[i]);
    }
    for (size_t r = 0; poison_from >= 0 && r < size_t{heads} * rows; ++r) {
      if (static_cast<int64_t>(r % rows) < poison_from) continue;
      uint8_t* row = dst->data() + r * d * kernels::DTypeSize(dtype);
      for (uint32_t j = 0; j < d; ++j) {
        switch (dtype) {
          case DType::kFP8:
            row[j] = 0x7f;  // e4m3fn NaN (its row scale stays finite)
            break;
          case DType::kF32: {
            const float nan = std::nanf("");
            std::memcpy(row + 4 * j, &nan, 4);
            break;
          }
          default:  // fp16 0x7e00, bf16 0x7fc0: both NaN
            reinterpret_cast<uint16_t*>(row)[j] = dtype == DType::kF16 ? 0x7e00 : 0x7fc0;
        }
      }
    }
  }
  t->slot.obj = HostObject(Engine(), t->k, t->v);
  t->slot.gpu = true;
  Status up = RequireGpu(Engine(), t->slot.obj);
  EXPECT_TRUE(up.ok()) << up.message();
  t->pin = t->slot.obj->Gpu();
  return t;
}

struct Case {
  Form form = Form::kDense;
  uint32_t hq = 8, heads = 2, m = 1, n = 1000, d = 64;
  DType dtype = DType::kF32;
  int64_t window = 0;
  int64_t qpos = -1;  // −1: right after the prefix
  uint32_t top_k = 0, block = 32, k_top = 4, suffix = 0;
  kernels::BlockSelector selector = kernels::BlockSelector::kMean;
  bool shared = false;  // SHARED sparse-auto
  uint32_t recent = 0;  // RECENT sparse-auto
  Keys keys = Keys::kRandom;
  int64_t poison_from = -1;  // MakeSlot: NaN rows from there on (rows no query sees)
};

std::string Describe(const Case& c) {
  return "form=" + std::string(FormName(c.form)) + " hq=" + std::to_string(c.hq) +
         " heads=" + std::to_string(c.heads) + " m=" + std::to_string(c.m) +
         " n=" + std::to_string(c.n) + " d=" + std::to_string(c.d) +
         " dtype=" + std::string(kernels::DTypeName(c.dtype)) +
         " window=" + std::to_string(c.window) + " qpos=" + std::to_string(c.qpos) +
         (c.shared ? " shared" : "") + " recent=" + std::to_string(c.recent);
}

// `receipt`: the GPU run's receipt, for checks of the path it took.
void Check(const Case& c, uint32_t seed = 1, Receipt* receipt = nullptr) {
  SCOPED_TRACE(Describe(c));
  std::mt19937 rng(seed);
  auto ts = MakeSlot(c.heads, c.n, c.d, c.dtype, rng, c.keys, c.block, c.poison_from);
  auto q = Randn(size_t{c.hq} * c.m * c.d, rng);
  std::vector<int32_t> map(c.hq);
  for (uint32_t h = 0; h < c.hq; ++h) map[h] = static_cast<int32_t>(h / (c.hq / c.heads));
  Plan p;
  p.form = c.form;
  p.q = {q.data(), c.hq, c.m, c.d, map.data(), c.qpos >= 0 ? c.qpos : int64_t{c.n}};
  p.window = c.window;
  p.top_k = c.top_k;
  p.mass_bound = true;
  std::vector<float> ks, vs;
  if (c.suffix > 0) {
    ks = Randn(size_t{c.heads} * c.suffix * c.d, rng);
    vs = Randn(ks.size(), rng);
    p.k_suffix = {ks.data(), DType::kF32, c.heads, c.suffix, c.d};
    p.v_suffix = {vs.data(), DType::kF32, c.heads, c.suffix, c.d};
  }
  std::vector<int32_t> rows, counts;
  if (c.form == Form::kSparse) {
    p.stride = std::min<uint32_t>(c.n, 200);
    rows.resize(size_t{c.hq} * p.stride);
    counts.resize(c.hq);
    for (uint32_t h = 0; h < c.hq; ++h) {
      std::vector<int32_t> all(c.n);
      for (uint32_t t = 0; t < c.n; ++t) all[t] = static_cast<int32_t>(t);
      std::shuffle(all.begin(), all.end(), rng);
      counts[h] = static_cast<int32_t>(p.stride - h % 3);
      std::copy(all.begin(), all.begin() + counts[h], rows.begin() + size_t{h} * p.stride);
    }
    p.rows = rows.data();
    p.counts = counts.data();
  }
  Summaries host_sum;
  std::shared_ptr<Summaries> dev_sum;
  if (c.form == Form::kSparseAuto || c.form == Form::kSparseAutoFused) {
    p.block = c.block;
    p.k_top = c.k_top;
    p.selector = c.selector;
    p.shared_blocks = c.shared;
    p.recent = c.recent;
    host_sum.block = c.block;
    host_sum.nblocks = (c.n + c.block - 1) / c.block;
    const size_t ns = size_t{c.heads} * host_sum.nblocks * c.d;
    host_sum.mean.resize(ns);
    host_sum.min.resize(ns);
    host_sum.max.resize(ns);
    kernels::ReferenceKernels().Summarize(ts->K(), host_sum.View(c.heads, c.d));
    auto s = ts->slot.SummariesFor(c.block, nullptr);
    ASSERT_TRUE(s.ok()) << s.status().message();
    dev_sum = s.value();
  }
  const bool sparse_out =
      c.form == Form::kSparse || c.form == Form::kSparseAuto || c.form == Form::kSparseAutoFused;
  const size_t out_rows = size_t{c.hq} * c.m;
  std::vector<float> ref(out_rows * c.d), ref_lse(out_rows), got(ref.size()), got_lse(out_rows);
  Receipt rr, rg;
  Plan pref = p;
  if (dev_sum) pref.summaries = host_sum.View(c.heads, c.d);
  ASSERT_TRUE(Run(kernels::ReferenceKernels(), Parallel{}, pref, ts->K(), ts->V(), ref.data(),
                  ref_lse.data(), &rr)
                  .ok());
  ASSERT_TRUE(static_cast<bool>(ts->pin));
  Status s = RunGpu(p, ts->slot, *ts->pin, dev_sum.get(), got.data(), got_lse.data(), &rg);
  ASSERT_TRUE(s.ok()) << s.message();

  kernels::cuda::AttendArgs probe;
  probe.dtype = c.dtype;
  probe.d = c.d;
  probe.hq = c.hq;
  probe.heads = c.heads;
  probe.m = c.m;
  // The batched tensor-core kernels round Q and P to 16 bits (flash-attention precision): fp16
  // in both of its batched shapes, bf16 and fp8 in the eight-group kernel (d <= 128).
  const int groups = kernels::cuda::FlashRowGroups(probe);
  const bool flash_precision =
      !sparse_out && c.form != Form::kTopK &&
      ((c.dtype == DType::kF16 && c.d <= 256 && groups >= 4) ||
       ((c.dtype == DType::kBF16 || c.dtype == DType::kFP8) && groups == 8));
  const float tol = flash_precision ? 4e-3f : 1e-4f;
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_NEAR(got[i], ref[i], tol * (1 + std::fabs(ref[i]))) << "output " << i;
  }
  for (size_t i = 0; i < out_rows; ++i) {
    if (std::isinf(ref_lse[i])) {
      ASSERT_TRUE(std::isinf(got_lse[i]) && got_lse[i] < 0) << "lse " << i;
    } else {
      ASSERT_NEAR(got_lse[i], ref_lse[i], tol * (1 + std::fabs(ref_lse[i]))) << "lse " << i;
    }
  }
  EXPECT_EQ(rg.exact, rr.exact);
  EXPECT_EQ(rg.rows_attended, rr.rows_attended);
  EXPECT_EQ(rg.visible_rows, rr.visible_rows);
  EXPECT_EQ(rg.support, rr.support);
  EXPECT_EQ(rg.blocks, rr.blocks);
  EXPECT_EQ(rg.blocks_total, rr.blocks_total);
  EXPECT_NEAR(rg.omitted_mass_estimate, rr.omitted_mass_estimate, 1e-4);
  // The bound: one logistic of the LSE each computed (within the output's tolerance).
  EXPECT_NEAR(rg.omitted_mass_bound, rr.omitted_mass_bound, 1e-2);
  if (receipt != nullptr) *receipt = rg;
  // fp8: what the storage costs, against the reference over the rows before encoding — for
  // the forms whose keys do not depend on the (fp8) scores.
  if (c.dtype == DType::kFP8 && !ts->k32.empty() &&
      (c.form == Form::kDense || c.form == Form::kFused || c.form == Form::kSparse)) {
    std::vector<float> exact(ref.size()), exact_lse(out_rows);
    Receipt re;
    ASSERT_TRUE(Run(kernels::ReferenceKernels(), Parallel{}, pref, ts->K32(), ts->V32(),
                    exact.data(), exact_lse.data(), &re)
                    .ok());
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      num += (double(got[i]) - exact[i]) * (double(got[i]) - exact[i]);
      den += double(exact[i]) * exact[i];
    }
    if (den > 0) {
      EXPECT_LE(num / den, 4e-3) << "fp8 relative MSE against fp32";
      // (A fused query may see only its fp32 suffix: no floor there.)
      if (c.form != Form::kFused) {
        EXPECT_GE(num / den, 3e-4) << "fp8 relative MSE against fp32: too exact for fp8";
      }
    }
  }
}

// One small case of every kernel variant: the compute-sanitizer (memcheck, racecheck) target.
TEST(GpuExecutor, Smoke) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8}) {
    // m = 1: 4 rows per K/V head (packed decode); 3: 12 rows (decode); 40: 160 (batched).
    for (uint32_t m : {1u, 3u, 40u}) {
      for (Form f : {Form::kDense, Form::kTopK, Form::kFused}) {
        Case c;
        c.form = f;
        c.dtype = t;
        c.m = m;
        c.n = 300;
        c.d = 64;
        c.top_k = 20;
        c.suffix = f == Form::kFused ? 20 : 0;
        Check(c);
      }
    }
    // M = 1 over 1001 and 2048 keys: the cluster decode's 16-key tiles (a partial last run)
    // and 32-key tiles — fp32 GQA 32/8 and MHA 8/8, fp16 and bf16 GQA.
    for (uint32_t n : {1001u, 2048u}) {
      for (uint32_t hq : {32u, 8u}) {
        if (((t == DType::kF16 || t == DType::kBF16) && hq == 8) || t == DType::kFP8) continue;
        Case c;
        c.hq = hq;
        c.heads = 8;
        c.n = n;
        c.d = 128;
        c.dtype = t;
        Check(c);
      }
    }
    for (Form f : {Form::kSparse, Form::kSparseAuto, Form::kSparseAutoFused}) {
      Case c;
      c.form = f;
      c.dtype = t;
      c.n = 300;
      c.d = 64;
      c.block = 16;
      c.k_top = 3;
      c.selector = kernels::BlockSelector::kQuest;
      c.suffix = f == Form::kSparseAutoFused ? 10 : 0;
      Check(c);
      if (f != Form::kSparse) {  // shared lists: the tensor-core kernel for fp16
        c.shared = true;
        Check(c);
      }
    }
  }
}

// Dense passes of dtype t at every head dim: M = 1, a few rows (decode), 160 rows (batched) and,
// where the eight-group kernel takes them, 520 rows under a window.
void CheckEveryHeadDim(DType t) {
  for (uint32_t d : {32u, 64u, 96u, 128u, 160u, 192u, 256u, 512u}) {
    Case c;
    c.d = d;
    c.dtype = t;
    c.n = 777;
    Check(c);
    c.m = 5;  // a few rows: the decode path
    Check(c);
    c.m = 40;  // 4 heads per K/V head × 40 rows: the batched path (eight groups at d = 128)
    Check(c);
    if ((t == DType::kF16 && d < 128) || ((t == DType::kBF16 || t == DType::kFP8) && d <= 128)) {
      c.m = 130;  // 520 rows: eight row groups a block (fp16 below d = 128 too), the last partial
      c.window = 300;
      Check(c);
      c.window = 0;
    }
  }
}

// GQA groups, windows and query positions (after the prefix, inside it, at 0) of dtype t, at
// 1, 7 and 33 positions (up to 264 rows a K/V head: the batched path).
void CheckGqaWindowsAndPositions(DType t) {
  for (auto [hq, heads] : {std::pair{4u, 4u}, {8u, 2u}, {32u, 4u}, {16u, 2u}}) {
    for (int64_t window : {0, 1, 100}) {
      for (uint32_t m : {1u, 7u, 33u}) {
        Case c;
        c.hq = hq;
        c.heads = heads;
        c.dtype = t;
        c.window = window;
        c.m = m;
        c.n = 1500;
        c.d = 128;
        Check(c);
        c.qpos = 700;  // inside the prefix: later keys are hidden
        Check(c);
        c.qpos = 0;
        Check(c);
      }
    }
  }
}

TEST(GpuExecutor, DenseEveryHeadDimAndDtype) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8}) CheckEveryHeadDim(t);
}

// bf16 decode on the tensor cores (the fp16 decode shapes on bf16 MMAs; M = 1 with up to 8 rows
// a K/V head on the streaming decode) — packed (up to 8 rows a K/V head) and split (9..16) — at
// the fp32 tolerance, long ranges (many tiles a warp, interleaved) and windows; batched bf16 on
// the eight-group kernel (LowpBatched(), the default).
TEST(GpuExecutor, Bf16DecodeOnTensorCores) {
  SKIP_WITHOUT_GPU();
  kernels::cuda::AttendArgs probe;
  probe.dtype = DType::kBF16;
  probe.dense_items = true;
  probe.d = 128;
  probe.hq = 32;
  probe.heads = 8;
  probe.m = 1;
  EXPECT_EQ(kernels::cuda::UsesTensorCores(probe), gpu::Info().cc_major >= 8);
  probe.m = 40;  // 160 rows a K/V head: batched, the eight-group kernel by default
  EXPECT_TRUE(kernels::cuda::LowpBatched());
  EXPECT_EQ(kernels::cuda::UsesTensorCores(probe), gpu::Info().cc_major >= 8);
  for (uint32_t d : {64u, 128u, 256u}) {
    for (auto [hq, heads, m] :
         {std::tuple{32u, 8u, 1u}, {8u, 1u, 1u}, {12u, 1u, 1u}, {16u, 2u, 2u}, {4u, 2u, 3u}}) {
      for (uint32_t n : {100u, 5000u, 40000u}) {
        if (d == 256 && n > 5000) continue;
        Case c;
        c.dtype = DType::kBF16;
        c.d = d;
        c.hq = hq;
        c.heads = heads;
        c.m = m;
        c.n = n;
        Check(c);
        c.window = 777;
        c.qpos = n - 10;
        Check(c, 2);
      }
    }
  }
}

// Sets kernels::cuda::SetLowpBatched for a scope, and back.
struct LowpBatchedScope {
  explicit LowpBatchedScope(bool on) : was(kernels::cuda::LowpBatched()) {
    kernels::cuda::SetLowpBatched(on);
  }
  ~LowpBatchedScope() { kernels::cuda::SetLowpBatched(was); }
  bool was;
};

// bf16 and fp8 with 64 or more query rows a K/V head on the eight-group batched tensor-core
// kernel (kernels::cuda::LowpBatched(), the default) and, with it off, on the SIMT kernel: the
// head-dim and GQA / window / position cases of the default path's tests, a fused suffix, and a
// long range over several splits with a half-empty block, at flash-attention precision (Check:
// 4e-3); d > 128 stays on the SIMT kernel.
TEST(GpuExecutor, LowpBatched) {
  SKIP_WITHOUT_GPU();
  EXPECT_TRUE(kernels::cuda::LowpBatched());
  LowpBatchedScope scope(true);
  kernels::cuda::AttendArgs probe;
  probe.dense_items = true;
  probe.hq = 32;
  probe.heads = 8;
  probe.m = 40;
  for (DType t : {DType::kBF16, DType::kFP8}) {
    probe.dtype = t;
    probe.d = 128;
    EXPECT_EQ(kernels::cuda::FlashRowGroups(probe), 8);
    EXPECT_EQ(kernels::cuda::UsesTensorCores(probe), gpu::Info().cc_major >= 8);
    probe.d = 256;
    EXPECT_FALSE(kernels::cuda::UsesTensorCores(probe));
    CheckEveryHeadDim(t);
    CheckGqaWindowsAndPositions(t);
    Case f;
    f.form = Form::kFused;
    f.dtype = t;
    f.m = 40;
    f.n = 300;
    f.d = 64;
    f.suffix = 20;
    Check(f);
    Case l;
    l.dtype = t;
    l.hq = 32;
    l.heads = 8;
    l.m = 16;
    l.n = 40000;
    l.d = 128;
    Check(l);
  }
  LowpBatchedScope simt(false);  // the SIMT kernel: the same cases' core
  for (DType t : {DType::kBF16, DType::kFP8}) {
    probe.dtype = t;
    probe.d = 128;
    EXPECT_EQ(kernels::cuda::FlashRowGroups(probe), 4);
    EXPECT_FALSE(kernels::cuda::UsesTensorCores(probe));
    CheckGqaWindowsAndPositions(t);
  }
}

// The eight-group batched kernel (flash_batched.cu) alone, every element type: the
// compute-sanitizer target for that kernel. Kept apart from Smoke because racecheck, in a process
// where the decode kernels' mbarriers were initialized first, has reported reads of a later
// kernel's static shared arrays against those MbarInit writes
// (bench/results/attention-gpu-2026-12-02.md): here no kernel with mbarriers runs before it,
// so a hazard it reports is this kernel's. Small cases: one split and several (partial last
// tiles), d = 64 and 128, a window, a query inside the prefix, a fused suffix, padding rows.
TEST(GpuExecutor, BatchedSmoke) {
  SKIP_WITHOUT_GPU();
  LowpBatchedScope scope(true);
  for (DType t : {DType::kF16, DType::kBF16, DType::kFP8}) {
    for (uint32_t d : {64u, 128u}) {
      Case c;
      c.dtype = t;
      c.d = d;
      c.hq = 8;
      c.heads = 2;
      // fp16 takes eight groups from 128 rows a K/V head at d = 128, from 512 below; bf16 and
      // fp8 from 64. 130 positions × 4 heads = 520 rows: 5 blocks of 128, the last mostly padding.
      c.m = t == DType::kF16 && d < 128 ? 130 : 40;
      c.n = 300;
      kernels::cuda::AttendArgs probe;
      probe.dtype = t;
      probe.dense_items = true;
      probe.d = d;
      probe.hq = c.hq;
      probe.heads = c.heads;
      probe.m = c.m;
      ASSERT_EQ(kernels::cuda::FlashRowGroups(probe), 8) << kernels::DTypeName(t) << " d=" << d;
      Check(c);
      c.n = 2000;  // several splits, partial last tiles
      c.window = 333;
      Check(c, 2);
      c.window = 0;
      c.qpos = 900;
      Check(c, 3);
      c.qpos = -1;
      c.n = 300;
      c.form = Form::kFused;
      c.suffix = 20;
      Check(c, 4);
    }
  }
}

// Sets kernels::cuda::SetStreamDecodeTile for a scope, and back to the default.
struct StreamTileScope {
  explicit StreamTileScope(uint32_t keys) { kernels::cuda::SetStreamDecodeTile(keys); }
  ~StreamTileScope() { kernels::cuda::SetStreamDecodeTile(0); }
};

// Sets kernels::cuda::SetStreamDecodeTeams for a scope, and back to the plan's choice.
struct StreamTeamsScope {
  explicit StreamTeamsScope(uint32_t n) { kernels::cuda::SetStreamDecodeTeams(n); }
  ~StreamTeamsScope() { kernels::cuda::SetStreamDecodeTeams(0); }
};

// The streaming decode's probe for a dense M = 1 shape (items as DenseItems lays them out).
kernels::cuda::AttendArgs StreamProbe(DType t, uint32_t d, uint32_t hq, uint32_t heads) {
  kernels::cuda::AttendArgs probe;
  probe.dtype = t;
  probe.d = d;
  probe.hq = hq;
  probe.heads = heads;
  probe.m = 1;
  probe.n_items = heads;
  probe.uniform_group = hq / heads;
  probe.rows = 5000;
  probe.k = probe.v = probe.k_scale = probe.v_scale = reinterpret_cast<const float*>(256);
  probe.dense_items = true;
  return probe;
}

// M = 1 on the streaming decode (decode_stream.cu, sm_90): fp16, bf16 and fp8, d 64 and 128,
// groups of 1, 2, 4 and 8 query heads a K/V head, its tiles of 16 KB and of 64 keys, blocks of
// one team and — where a ring holds under 64 KB — two (forced: these ranges plan one), one split
// (finished in the launch) and many, a range shorter than a tile, windows whose first key starts
// mid-tile (fp8: its row scales off a 16-byte boundary), and queries inside the prefix whose
// last tile is partial with NaN rows past it (V rows past the range are zeroed before P·V), a
// fused suffix.
TEST(GpuExecutor, StreamDecode) {
  SKIP_WITHOUT_GPU();
  const bool hopper = gpu::Info().cc_major >= 9;
  for (auto [tile, teams] : {std::pair{0u, 0u}, {64u, 0u}, {0u, 2u}, {64u, 2u}}) {
    StreamTileScope scope(tile);
    StreamTeamsScope teams_scope(teams);
    for (DType t : {DType::kF16, DType::kBF16, DType::kFP8}) {
      for (uint32_t d : {64u, 128u}) {
        for (auto [hq, heads] : {std::pair{8u, 8u}, {16u, 8u}, {32u, 8u}, {16u, 2u}}) {
          const auto probe = StreamProbe(t, d, hq, heads);
          ASSERT_EQ(kernels::cuda::StreamDecodeFits(probe), hopper);
          if (hopper) {
            const uint32_t want = tile == 64 || (t != DType::kFP8 && d == 128) ? 64 : 128;
            EXPECT_EQ(kernels::cuda::StreamDecodeTile(probe), want);
            if (tile == 0 && teams == 0) {  // the plan: two teams for fp8 d = 64's long ranges
              const bool f8d64 = t == DType::kFP8 && d == 64;
              EXPECT_EQ(kernels::cuda::StreamDecodeTeams(probe, 131072), f8d64 ? 2u : 1u);
              EXPECT_EQ(kernels::cuda::StreamDecodeTeams(probe, 1024), 1u);
            }
          }
          // Two teams: only the shapes whose ring holds under 64 KB (fp8 d = 64; with 64-key
          // tiles also fp16 / bf16 d = 64 and fp8 d = 128) take them; the others ran above.
          if (teams == 2 && (!hopper || kernels::cuda::StreamDecodeTeams(probe, 5000) != 2)) {
            continue;
          }
          SCOPED_TRACE("tile " + std::to_string(tile) + ", teams " + std::to_string(teams));
          Case c;
          c.dtype = t;
          c.d = d;
          c.hq = hq;
          c.heads = heads;
          c.n = 5000;  // past the cluster decode's ranges: the streaming decode's
          Check(c, 1);
          c.window = 333;  // the first visible key mid-tile
          Check(c, 2);
          c.window = 0;
          c.n = 4100;
          c.qpos = 3000;  // the last tile partial, NaN rows past it
          c.poison_from = 3001;
          Check(c, 3);
          c.window = 700;
          c.qpos = 3333;
          c.poison_from = 3334;
          Check(c, 4);
          c.window = 0;
          c.qpos = -1;
          c.poison_from = -1;
          c.n = 70;  // one split, finished in the launch (fp16/bf16 ≤ 4 heads: cluster decode)
          Check(c, 5);
          c.qpos = 40;  // fewer keys than a tile
          c.poison_from = 41;
          Check(c, 6);
          c.form = Form::kFused;
          c.n = 3000;
          c.qpos = -1;
          c.poison_from = -1;
          c.suffix = 20;
          Check(c, 7);
        }
      }
    }
  }
}

// The streaming decode's sanitizer target: small ranges of every element type, head dim, tile
// and team count, a window off a 16-byte boundary and a partial last tile with NaN rows past it.
TEST(GpuExecutor, StreamDecodeSmoke) {
  SKIP_WITHOUT_GPU();
  const bool hopper = gpu::Info().cc_major >= 9;
  for (auto [tile, teams] : {std::pair{0u, 0u}, {64u, 0u}, {0u, 2u}, {64u, 2u}}) {
    StreamTileScope scope(tile);
    StreamTeamsScope teams_scope(teams);
    for (DType t : {DType::kF16, DType::kBF16, DType::kFP8}) {
      for (uint32_t d : {64u, 128u}) {
        if (teams == 2 &&
            (!hopper || kernels::cuda::StreamDecodeTeams(StreamProbe(t, d, 16, 2), 900) != 2)) {
          continue;  // one team only: ran above
        }
        Case c;
        c.dtype = t;
        c.d = d;
        c.hq = 16;
        c.heads = 2;  // 8 query heads a K/V head: never the cluster decode
        c.n = 900;
        c.window = 301;
        c.qpos = 777;
        c.poison_from = 778;
        Check(c, 11);
      }
    }
  }
}

// Sets kernels::cuda::SetOverlapCalls for a scope, and back to the default (on).
struct OverlapScope {
  explicit OverlapScope(bool on) { kernels::cuda::SetOverlapCalls(on); }
  ~OverlapScope() { kernels::cuda::SetOverlapCalls(true); }
};

// Back-to-back calls (OverlapCalls): each streaming decode lets the launch after it place its
// blocks from its start and waits for the launch before it only where it writes its partials,
// so calls queued with no wait between them overlap. Six calls with different queries over the
// same partials (split-K + combine, and one split finished in the launch over the same
// counters), queued at once on one stream, each against the scalar reference (1e-4) — with the
// overlap and without, both tile sizes; a call that wrote its partials before the previous
// call's combine read them would return the wrong output.
TEST(GpuExecutor, StreamDecodeBackToBack) {
  SKIP_WITHOUT_GPU();
  if (gpu::Info().cc_major < 9) GTEST_SKIP() << "the streaming decode runs on sm_90";
  auto ctx_or = gpu::Context::ForThisThread();
  ASSERT_TRUE(ctx_or.ok()) << ctx_or.status().message();
  gpu::Context* ctx = ctx_or.value();
  constexpr uint32_t kCalls = 6, hq = 32, heads = 8, n = 6000;
  const std::pair<DType, uint32_t> shapes[] = {
      {DType::kF16, 128}, {DType::kBF16, 64}, {DType::kFP8, 128}, {DType::kFP8, 64}};
  std::vector<int32_t> map(hq);
  for (uint32_t h = 0; h < hq; ++h) map[h] = static_cast<int32_t>(h / (hq / heads));
  for (auto [t, d] : shapes) {
    std::mt19937 rng(17 + d);
    auto ts = MakeSlot(heads, n, d, t, rng);
    ASSERT_TRUE(static_cast<bool>(ts->pin));
    const auto q = Randn(size_t{kCalls} * hq * d, rng);
    const size_t per = size_t{hq} * d;  // output floats a call (then hq LSEs)
    std::vector<float> ref(kCalls * per), ref_lse(kCalls * hq);
    for (uint32_t c = 0; c < kCalls; ++c) {
      Plan p;
      p.q = {q.data() + c * per, hq, 1, d, map.data(), int64_t{n}};
      Receipt r;
      ASSERT_TRUE(attention::Run(kernels::ReferenceKernels(), Parallel{}, p, ts->K(), ts->V(),
                                 ref.data() + c * per, ref_lse.data() + c * hq, &r)
                      .ok());
    }
    for (bool overlap : {true, false}) {
      OverlapScope os(overlap);
      for (auto [tile, teams] : {std::pair{0u, 0u}, {64u, 0u}, {0u, 2u}}) {
        StreamTileScope scope(tile);
        StreamTeamsScope teams_scope(teams);
        if (teams == 2 && kernels::cuda::StreamDecodeTeams(StreamProbe(t, d, hq, heads), n) != 2) {
          continue;  // one team only: ran above
        }
        ctx->Reset();
        auto dq = ctx->Device(q.size() * sizeof(float));
        ASSERT_TRUE(dq.ok());
        ASSERT_TRUE(ctx->ToDevice(dq.value(), q.data(), q.size() * sizeof(float)).ok());
        kernels::cuda::AttendArgs a;
        a.hq = hq;
        a.m = 1;
        a.d = d;
        a.q_pos0 = n;
        a.k = ts->pin->block(0);
        a.v = ts->pin->block(1);
        a.dtype = t;
        a.k_scale = kernels::MakeTensor(a.k, t, heads, n, d).scales;
        a.v_scale = kernels::MakeTensor(a.v, t, heads, n, d).scales;
        a.heads = heads;
        a.rows = n;
        a.end = n;
        a.scale = 1.0f / std::sqrt(static_cast<float>(d));
        a.nrows = hq;
        a.dense_items = true;
        const auto items = kernels::cuda::DenseItems(hq, 1, map.data());
        auto di = ctx->Device(items.size() * sizeof(items[0]));
        ASSERT_TRUE(di.ok());
        ASSERT_TRUE(ctx->ToDevice(di.value(), items.data(), items.size() * sizeof(items[0])).ok());
        a.items = static_cast<const kernels::cuda::Item*>(di.value());
        a.n_items = static_cast<uint32_t>(items.size());
        a.item_rows = kernels::cuda::MaxRows(items);
        a.uniform_group = kernels::cuda::UniformGroup(items, 1);
        ASSERT_TRUE(kernels::cuda::StreamDecodeFits(a));
        const uint32_t planned = kernels::cuda::PlanSplits(a, n);
        ASSERT_GT(planned, 1u);
        for (uint32_t splits : {planned, 1u}) {
          SCOPED_TRACE(std::string(kernels::DTypeName(t)) + " d " + std::to_string(d) +
                       ", overlap " + std::to_string(overlap) + ", tile " + std::to_string(tile) +
                       ", teams " + std::to_string(teams) + ", splits " + std::to_string(splits));
          auto pm = ctx->Device(size_t{splits} * hq * sizeof(float));
          auto pl = ctx->Device(size_t{splits} * hq * sizeof(float));
          auto po = ctx->Device(size_t{splits} * per * sizeof(float));
          auto out = ctx->Device(kCalls * (per + hq) * sizeof(float));
          auto counters = ctx->Counters(kernels::cuda::GridBlocks(a));
          ASSERT_TRUE(pm.ok() && pl.ok() && po.ok() && out.ok() && counters.ok());
          ASSERT_TRUE(ctx->Memset(out.value(), 0xff, kCalls * (per + hq) * sizeof(float)).ok());
          auto* dout = static_cast<float*>(out.value());
          a.splits = splits;
          a.part_m = static_cast<float*>(pm.value());
          a.part_l = static_cast<float*>(pl.value());
          a.part_o = static_cast<float*>(po.value());
          for (uint32_t c = 0; c < kCalls; ++c) {
            a.q = static_cast<const float*>(dq.value()) + c * per;
            float* o = dout + c * per;
            float* lse = dout + kCalls * per + c * hq;
            a.counters = splits == 1 ? counters.value() : nullptr;
            a.out = splits == 1 ? o : nullptr;
            a.lse = splits == 1 ? lse : nullptr;
            ASSERT_TRUE(kernels::cuda::LaunchAttend(a, ctx->stream()).ok());
            if (splits > 1) {
              ASSERT_TRUE(kernels::cuda::LaunchCombine(splits, hq, d, a.part_m, a.part_l, a.part_o,
                                                       o, lse, ctx->stream())
                              .ok());
            }
          }
          std::vector<float> got(kCalls * (per + hq));
          ASSERT_TRUE(ctx->ToHost(got.data(), dout, got.size() * sizeof(float)).ok());
          ASSERT_TRUE(ctx->Sync().ok());
          for (size_t i = 0; i < ref.size(); ++i) {
            ASSERT_NEAR(got[i], ref[i], 1e-4 * (1 + std::fabs(ref[i])))
                << "call " << i / per << ", output " << i % per;
          }
          for (size_t i = 0; i < ref_lse.size(); ++i) {
            ASSERT_NEAR(got[kCalls * per + i], ref_lse[i], 1e-4 * (1 + std::fabs(ref_lse[i])))
                << "call " << i / hq << ", lse " << i % hq;
          }
        }
      }
    }
  }
}

// M = 1 over short ranges: the one launch of a thread-block cluster a K/V head
// (decode_cluster.cu) where the device takes it — every group size up to 8 query heads a K/V
// head, both of its head dims and dtypes, ranges shorter than its 64 warps, a tile's tail, a
// window and a query inside the prefix; the receipt names the cluster's 8 blocks.
TEST(GpuExecutor, DecodeClusterGroupsAndRanges) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (uint32_t d : {64u, 128u}) {
      for (auto [hq, heads] :
           {std::pair{8u, 8u}, {8u, 4u}, {12u, 4u}, {32u, 8u}, {40u, 8u}, {64u, 8u}, {3u, 1u}}) {
        // 2048 and up: 32-key tiles (8-warp blocks), whole or with a partial last run.
        for (uint32_t n : {5u, 61u, 1000u, 2048u, 2049u, 3001u, 4096u}) {
          Case c;
          c.hq = hq;
          c.heads = heads;
          c.d = d;
          c.dtype = t;
          c.n = n;
          Receipt r;
          Check(c, 1, &r);
          const bool one = kernels::cuda::DecodeClusterFits(t, d, hq / heads, heads, n);
          EXPECT_EQ(r.splits, one ? uint32_t{kernels::cuda::kDecodeCluster} : r.splits);
          if (n > 61) {
            c.window = 37;
            c.qpos = n / 2;
            Check(c, 2);
            c.window = 0;
          }
          if (n > 2048) {  // a window of 2100 keys, not from row 0
            c.window = 2100;
            c.qpos = n - 3;
            Check(c, 3);
            c.window = 0;
            c.qpos = -1;
          }
        }
      }
    }
  }
  if (gpu::Info().cc_major >= 9) {
    EXPECT_TRUE(kernels::cuda::DecodeClusterFits(DType::kF32, 128, 4, 8, 2048));
    EXPECT_FALSE(kernels::cuda::DecodeClusterFits(DType::kF32, 128, 9, 8, 2048));
    EXPECT_TRUE(kernels::cuda::DecodeClusterFits(DType::kBF16, 128, 4, 8, 2048));
    EXPECT_FALSE(kernels::cuda::DecodeClusterFits(DType::kFP8, 128, 4, 8, 2048));
    EXPECT_FALSE(kernels::cuda::DecodeClusterFits(
        DType::kF32, 128, 4, 8, kernels::cuda::DecodeClusterMaxKeys(DType::kF32) + 1));
  }
}

TEST(GpuExecutor, GqaWindowsAndPositions) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8}) {
    CheckGqaWindowsAndPositions(t);
  }
}

TEST(GpuExecutor, LongPrefixSplits) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8}) {
    Case c;
    c.hq = 32;
    c.heads = 8;
    c.n = 70000;
    c.d = 128;
    c.dtype = t;
    Check(c);
    // Under a window, the queries inside the prefix: the long decode ranges (fp16: interleaved
    // tiles, at least 32 a block) with masked tiles at both ends; 12 rows a group at M = 3.
    c.window = 30001;
    c.qpos = 50007;
    Check(c);
    c.m = 3;
    Check(c);
    c.window = 0;
    c.qpos = -1;
    c.n = 20000;
    c.m = 16;  // 64 rows per K/V head: the batched path
    Check(c);
  }
}

// fp32 over 8K keys or more runs the SIMT kernel's long-range shape (two-stage ring, three
// blocks a multiprocessor): every head dim, with and without a window, GQA.
TEST(GpuExecutor, LongFp32RangesEveryHeadDim) {
  SKIP_WITHOUT_GPU();
  for (uint32_t d : {32u, 64u, 96u, 128u, 160u, 192u, 256u, 512u}) {
    for (int64_t window : {0, 3000}) {
      Case c;
      c.dtype = DType::kF32;
      c.d = d;
      c.n = 9000;
      c.window = window;
      c.m = 2;
      Check(c);
    }
  }
}

TEST(GpuExecutor, TopK) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8}) {
    for (uint32_t k : {1u, 17u, 300u, 5000u}) {
      Case c;
      c.form = Form::kTopK;
      c.dtype = t;
      c.top_k = k;
      c.m = 3;
      c.n = 3000;
      Check(c);
      c.window = 50;
      Check(c);
    }
  }
}

TEST(GpuExecutor, FusedSuffix) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8}) {
    for (uint32_t m : {1u, 4u, 64u}) {
      Case c;
      c.form = Form::kFused;
      c.dtype = t;
      c.m = m;
      c.suffix = 80;
      c.n = 900;
      Check(c);
      c.window = 60;  // the window ends inside the suffix for some rows
      Check(c);
    }
  }
}

TEST(GpuExecutor, CallerSparse) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8}) {
    for (uint32_t d : {64u, 128u, 512u}) {
      Case c;
      c.form = Form::kSparse;
      c.dtype = t;
      c.d = d;
      c.n = 1200;
      Check(c);
      c.window = 300;
      Check(c);
    }
  }
}

TEST(GpuExecutor, SparseAuto) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8}) {
    for (auto sel : {kernels::BlockSelector::kMean, kernels::BlockSelector::kQuest}) {
      for (uint32_t k_top : {0u, 3u, 20u, 1000u}) {
        for (bool shared : {false, true}) {
          Case c;
          c.form = Form::kSparseAuto;
          c.dtype = t;
          c.selector = sel;
          c.k_top = k_top;
          c.shared = shared;
          c.n = 4000;
          c.block = 64;
          Check(c);
          c.window = 1000;
          Check(c);
          c.form = Form::kSparseAutoFused;
          c.suffix = 30;
          Check(c);
          // RECENT (the four launches: the one-launch kernel does not take it).
          c.recent = std::min(k_top, 2u);
          c.form = Form::kSparseAuto;
          c.suffix = 0;
          c.window = 0;
          Check(c);
        }
      }
    }
  }
}

// SHARED sparse-auto without a suffix runs as one launch where it fits (fp16, d 64/128, <= 8
// query heads a K/V head, sm_90; sparse_fused.cu): clusters of 16 (few K/V heads) and of 8 (more
// heads than clusters of 16 run at once), groups of one to eight query heads, Quest, a window, one
// or two visible blocks, every candidate chosen, the most visible blocks one launch takes and one
// more (the four launches then), against the CPU reference, receipts included.
TEST(GpuExecutor, SparseAutoSharedOneLaunch) {
  SKIP_WITHOUT_GPU();
  using kernels::BlockSelector;
  struct Shape {
    uint32_t hq, heads, n, d, block, k_top;
    int64_t window;
    BlockSelector sel;
    bool one_launch;
  };
  const Shape shapes[] = {
      {8, 8, 4000, 128, 64, 20, 0, BlockSelector::kMean, true},        // G = 1
      {64, 8, 4000, 64, 64, 20, 1000, BlockSelector::kQuest, true},    // G = 8, window
      {36, 12, 5000, 128, 32, 50, 0, BlockSelector::kMean, true},      // 12 heads, G = 3
      {8, 2, 100, 64, 64, 3, 0, BlockSelector::kMean, true},           // two visible blocks
      {8, 2, 50, 128, 64, 3, 0, BlockSelector::kQuest, true},          // one
      {8, 2, 1000, 64, 64, 1000, 0, BlockSelector::kMean, true},       // every candidate
      {8, 2, 2050 * 16, 64, 16, 100, 0, BlockSelector::kMean, true},   // the most blocks
      {8, 2, 2051 * 16, 64, 16, 100, 0, BlockSelector::kMean, false},  // one more
      {72, 8, 3000, 128, 64, 10, 0, BlockSelector::kMean, false},      // G = 9: four launches
      {32, 32, 3000, 64, 64, 10, 0, BlockSelector::kMean, false},      // more heads than clusters
  };
  const bool clusters = kernels::cuda::SparseAutoSharedFits(DType::kF16, 64, 1, 1, 1);
  // On Hopper (the sm_90a build) the one launch must be available: a check of the loaded code
  // that wrongly refused it would otherwise only show as slower queries.
  if (gpu::Info().cc_major == 9) {
    EXPECT_TRUE(clusters);
  }
  // K/V heads beyond the clusters the device runs at once take the four launches (no waves).
  if (clusters) {
    const auto most = static_cast<uint32_t>(kernels::cuda::SparseAutoSharedActiveClusters(64, 8));
    EXPECT_TRUE(kernels::cuda::SparseAutoSharedFits(DType::kF16, 64, 1, 100, most));
    EXPECT_FALSE(kernels::cuda::SparseAutoSharedFits(DType::kF16, 64, 1, 100, most + 1));
    EXPECT_LT(most, 32u);  // the 32-head shape below must take the four launches
  }
  for (const Shape& sh : shapes) {
    Case c;
    c.form = Form::kSparseAuto;
    c.dtype = DType::kF16;
    c.shared = true;
    c.hq = sh.hq;
    c.heads = sh.heads;
    c.n = sh.n;
    c.d = sh.d;
    c.block = sh.block;
    c.k_top = sh.k_top;
    c.window = sh.window;
    c.selector = sh.sel;
    Receipt r;
    Check(c, 1, &r);
    if (sh.hq == sh.heads) {  // one query head per K/V head: per-head choice, the same launch
      Receipt per_head;
      c.shared = false;
      Check(c, 1, &per_head);
      if (clusters && sh.one_launch) {
        EXPECT_EQ(per_head.splits, kernels::cuda::SparseAutoSharedCluster(sh.d, sh.heads))
            << Describe(c);
      }
      c.shared = true;
    }
    if (clusters && sh.one_launch) {  // a one-launch receipt reports the cluster size as splits
      EXPECT_EQ(r.splits, kernels::cuda::SparseAutoSharedCluster(sh.d, sh.heads)) << Describe(c);
    }
  }
}

// Block scores that tie or crowd into a few values: the selection's one-pass histogram either
// ranks a few equal keys (ties to the lower block, as the CPU) or hands over to the radix select
// (a bin of more than 32 keys); the chosen blocks must be the CPU's either way.
TEST(GpuExecutor, SparseAutoTiedAndCrowdedScores) {
  SKIP_WITHOUT_GPU();
  for (Keys keys : {Keys::kRepeat, Keys::kOutlier}) {
    for (uint32_t n : {4000u, 2050u * 16}) {
      for (bool shared : {true, false}) {
        Case c;
        c.form = Form::kSparseAuto;
        c.dtype = DType::kF16;
        c.hq = 8;
        c.heads = 2;
        c.n = n;
        c.d = 64;
        c.block = n > 4000 ? 16 : 64;
        c.k_top = n > 4000 ? 100 : 20;
        c.shared = shared;
        c.keys = keys;
        SCOPED_TRACE(keys == Keys::kRepeat ? "repeated blocks" : "one outlying block");
        Check(c);
      }
    }
  }
}

// The work items the kernels take (host code: runs without a GPU). The kernels rely on an
// item's rows ascending by query position (its first and last rows bound its key range) and on
// item_rows bounding every item (<= 8 selects the packed decode shape).
TEST(GpuItems, RowsAscendByPositionCoverEveryRowOnce) {
  using kernels::cuda::Item;
  std::vector<std::vector<int32_t>> maps = {
      {0, 0, 0, 0, 1, 1, 1, 1},                                      // GQA 4
      {0, 1, 0, 1, 0, 1},                                            // interleaved heads
      {0, 1, 2, 3},                                                  // MHA
      {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},  // 20 heads on one
  };
  for (const auto& map : maps) {
    const uint32_t hq = static_cast<uint32_t>(map.size());
    for (uint32_t m : {1u, 3u, 40u}) {
      for (int pad : {1, 4}) {
        SCOPED_TRACE("hq=" + std::to_string(hq) + " m=" + std::to_string(m) +
                     " pad=" + std::to_string(pad));
        const auto items = kernels::cuda::DenseItems(hq, m, map.data(), pad);
        ASSERT_EQ(items.size() % pad, 0u);
        std::vector<int> seen(size_t{hq} * m, 0);
        int32_t most = 0;
        for (const Item& it : items) {
          ASSERT_LE(it.n, kernels::cuda::kItemRows);
          most = std::max(most, it.n);
          for (int j = 0; j < it.n; ++j) {
            const int32_t r = it.rows[j];
            ASSERT_GE(r, 0);
            ASSERT_LT(r, static_cast<int32_t>(hq * m));
            EXPECT_EQ(map[r / m], it.kv);
            ++seen[r];
            if (j > 0) {
              EXPECT_LE(it.rows[j - 1] % m, r % m) << "positions must ascend";
            }
          }
        }
        for (int c : seen) EXPECT_EQ(c, 1);
        EXPECT_EQ(kernels::cuda::MaxRows(items), static_cast<uint32_t>(most));
        const auto rows = kernels::cuda::RowItems(hq, m, map.data());
        ASSERT_EQ(rows.size(), size_t{hq} * m);
        for (uint32_t r = 0; r < hq * m; ++r) {
          EXPECT_EQ(rows[r].n, 1);
          EXPECT_EQ(rows[r].rows[0], static_cast<int32_t>(r));
          EXPECT_EQ(rows[r].kv, map[r / m]);
        }
        EXPECT_EQ(kernels::cuda::MaxRows(rows), 1u);
      }
    }
  }
  // GQA 4 at M = 1: 4 rows an item, the packed decode shape.
  const std::vector<int32_t> gqa = {0, 0, 0, 0, 1, 1, 1, 1};
  EXPECT_EQ(kernels::cuda::MaxRows(kernels::cuda::DenseItems(8, 1, gqa.data())), 4u);
  // Uniform groups (the decode kernels then skip loading the items): only unpadded M = 1 items
  // whose K/V head i holds query heads i*g .. i*g + g − 1.
  using kernels::cuda::DenseItems;
  using kernels::cuda::UniformGroup;
  EXPECT_EQ(UniformGroup(DenseItems(8, 1, gqa.data()), 1), 4u);
  EXPECT_EQ(UniformGroup(DenseItems(8, 1, gqa.data(), 4), 1), 0u);   // padded with empty items
  EXPECT_EQ(UniformGroup(DenseItems(8, 3, gqa.data()), 3), 0u);      // M = 3
  EXPECT_EQ(UniformGroup(DenseItems(6, 1, maps[1].data()), 1), 0u);  // interleaved heads
  EXPECT_EQ(UniformGroup(DenseItems(4, 1, maps[2].data()), 1), 1u);  // MHA
  EXPECT_EQ(UniformGroup(kernels::cuda::RowItems(4, 1, maps[2].data()), 1), 1u);
  EXPECT_EQ(UniformGroup(DenseItems(20, 1, maps[3].data()), 1), 0u);  // 16 + 4 rows
  const std::vector<int32_t> gaps = {0, 0, 2, 2};                     // K/V head 1 unused
  EXPECT_EQ(UniformGroup(DenseItems(4, 1, gaps.data()), 1), 0u);
  EXPECT_EQ(UniformGroup({}, 1), 0u);
}

TEST(GpuTier, DemotesUnpinnedReplicasOnlyAndPromotesBack) {
  SKIP_WITHOUT_GPU();
  auto engine = MakeEngine(3 << 20);
  std::vector<uint8_t> half(1 << 20, 1);
  auto a = HostObject(*engine, half, half);  // 2 MiB
  ASSERT_TRUE(RequireGpu(*engine, a).ok());
  residency::GpuPin pin = a->Gpu();
  ASSERT_TRUE(static_cast<bool>(pin));
  auto b = HostObject(*engine, half, half);
  Status full = RequireGpu(*engine, b);  // a is held: no room
  EXPECT_EQ(full.kind(), ErrorKind::kOom);
  EXPECT_NE(full.message().find("tier=gpu"), std::string::npos) << full.message();
  pin.Reset();
  ASSERT_TRUE(RequireGpu(*engine, b).ok());  // a leaves the GPU now (its host copy stays)
  EXPECT_FALSE(a->Resident(residency::Tier::kGpu));
  EXPECT_TRUE(a->Resident(residency::Tier::kHost));
  EXPECT_EQ(engine->gpu_budget().used(), 2u << 20);
  ASSERT_TRUE(RequireGpu(*engine, a).ok());  // and back, b going
  std::vector<uint8_t> back(1 << 20);
  residency::GpuPin again = a->Gpu();
  ASSERT_TRUE(gpu::Download(back.data(), again->block(1), back.size()).ok());
  EXPECT_EQ(back, half);
  EXPECT_FALSE(b->Resident(residency::Tier::kGpu));
  again.Reset();
  engine->SetGpuLimit(1 << 20);  // below what a holds: its copy leaves at once
  EXPECT_FALSE(a->Resident(residency::Tier::kGpu));
  EXPECT_EQ(engine->gpu_budget().used(), 0u);
  a.reset();
  b.reset();
  EXPECT_EQ(engine->gpu_budget().used(), 0u);
}

// Uploads straight from page-locked memory and through staging give the same bytes: a pinned
// block, a small plain one and a plain one larger than the staging buffers, each at its
// gpu::SpanOffsets offset (256-byte aligned: the small block's odd size is padded).
TEST(GpuTier, UploadsFromPinnedAndPlainMemoryByteExact) {
  SKIP_WITHOUT_GPU();
  auto pinned = gpu::PinnedHostAllocator()->Allocate(24 << 20);
  ASSERT_TRUE(pinned.ok());
  EXPECT_TRUE(gpu::IsPinned(pinned.value()->data(), pinned.value()->size()));
  auto small = BufferAllocator::Default()->Allocate(4096 + 17);
  auto large = BufferAllocator::Default()->Allocate((20 << 20) + 3);
  ASSERT_TRUE(small.ok() && large.ok());
  EXPECT_FALSE(gpu::IsPinned(large.value()->data(), large.value()->size()));
  uint32_t x = 12345;
  std::vector<gpu::HostSpan> spans;
  std::vector<uint64_t> sizes;
  for (BufferRef b : {pinned.value(), small.value(), large.value()}) {
    for (size_t i = 0; i < b->size(); ++i)
      b->data()[i] = static_cast<uint8_t>((x = x * 1664525u + 1013904223u) >> 24);
    spans.push_back({b->data(), b->size()});
    sizes.push_back(b->size());
  }
  uint64_t total = 0;
  const std::vector<uint64_t> offsets = gpu::SpanOffsets(sizes, &total);
  ASSERT_EQ(offsets.size(), 3u);
  for (uint64_t off : offsets) EXPECT_EQ(off % gpu::kSpanAlign, 0u);
  EXPECT_EQ(offsets[2], gpu::AlignSpan(offsets[1] + sizes[1]));
  EXPECT_GT(offsets[2], offsets[1] + sizes[1]);  // 4096 + 17 bytes: padded
  auto mem = gpu::Allocate(total);
  ASSERT_TRUE(mem.ok());
  gpu::Event done;
  ASSERT_TRUE(gpu::Upload(mem.value(), spans, &done).ok());
  // And back into page-locked memory (a demotion's path), span by span from its offset.
  for (size_t i = 0; i < spans.size(); ++i) {
    auto back = gpu::PinnedHostAllocator()->Allocate(sizes[i]);
    ASSERT_TRUE(back.ok());
    const auto* from = static_cast<const uint8_t*>(mem.value().data()) + offsets[i];
    ASSERT_TRUE(gpu::Download(back.value()->data(), from, sizes[i]).ok());
    EXPECT_EQ(0, std::memcmp(back.value()->data(), spans[i].data, sizes[i])) << "span " << i;
  }
  std::vector<uint8_t> too_big(total + 1);
  EXPECT_FALSE(gpu::Upload(mem.value(), {{too_big.data(), too_big.size()}}, nullptr).ok());
}

}  // namespace
}  // namespace pion::attention
