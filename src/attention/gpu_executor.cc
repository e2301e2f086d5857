#include "attention/gpu_executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention/visibility.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/gpu.h"

namespace pion::attention {
namespace {

using kernels::cuda::AttendArgs;
using kernels::cuda::Item;

#define PION_TRY(expr)         \
  do {                         \
    Status st_ = (expr);       \
    if (!st_.ok()) return st_; \
  } while (0)

// One query's device work on the thread's context: scratch allocation and uploads.
class Job {
 public:
  explicit Job(gpu::Context* c) : c_(c) { c_->Reset(); }
  void* stream() const { return c_->stream(); }
  gpu::Context* ctx() const { return c_; }

  template <typename T>
  StatusOr<T*> Dev(size_t n) {
    auto p = c_->Device(std::max<size_t>(n, 1) * sizeof(T));
    if (!p.ok()) return p.status();
    return static_cast<T*>(p.value());
  }
  // Host data → pinned staging; its device address is valid once Flush() ran (before the
  // first kernel that reads it): one transfer carries everything staged in between.
  template <typename T>
  StatusOr<T*> Up(const T* host, size_t n) {
    auto st = c_->Stage(std::max<size_t>(n, 1) * sizeof(T));
    if (!st.ok()) return st.status();
    if (n > 0) std::memcpy(st->host, host, n * sizeof(T));
    return static_cast<T*>(st->device);
  }
  Status Flush() { return c_->FlushStaged(); }
  // Pinned host scratch the kernels can write directly (unified addressing maps it into the
  // device's address space); its contents are valid after Sync().
  template <typename T>
  StatusOr<T*> Mapped(size_t n) {
    auto h = c_->Host(std::max<size_t>(n, 1) * sizeof(T));
    if (!h.ok()) return h.status();
    return static_cast<T*>(h.value());
  }
  // Device → pinned scratch (async); the host pointer is valid after Sync().
  template <typename T>
  StatusOr<T*> Down(const T* dev, size_t n) {
    auto h = c_->Host(std::max<size_t>(n, 1) * sizeof(T));
    if (!h.ok()) return h.status();
    Status s = c_->ToHost(h.value(), dev, n * sizeof(T));
    if (!s.ok()) return s;
    return static_cast<T*>(h.value());
  }

 private:
  gpu::Context* c_;
};

#define PION_ASSIGN(var, expr)                  \
  auto var##_or = (expr);                       \
  if (!var##_or.ok()) return var##_or.status(); \
  auto var = var##_or.value()
#define PION_ASSIGN_TO(var, expr)       \
  do {                                  \
    auto or_ = (expr);                  \
    if (!or_.ok()) return or_.status(); \
    var = or_.value();                  \
  } while (0)

// Results up to this size are written by the kernels into mapped pinned host memory.
constexpr size_t kDirectResultBytes = size_t{64} << 10;

// Partials of every output row: parts × rows × (m, l, o).
struct Parts {
  float* m = nullptr;
  float* l = nullptr;
  float* o = nullptr;
  uint32_t count = 0;  // parts written so far
};

Status AllocParts(Job& job, uint32_t parts, uint32_t nrows, uint32_t d, Parts* p) {
  PION_ASSIGN(m, job.Dev<float>(size_t{parts} * nrows));
  PION_ASSIGN(l, job.Dev<float>(size_t{parts} * nrows));
  PION_ASSIGN(o, job.Dev<float>(size_t{parts} * nrows * d));
  *p = Parts{m, l, o, 0};
  return Status::Ok();
}

// The arguments common to every attend launch over the slot (prefix keys at positions 0..N−1).
AttendArgs PrefixArgs(const Plan& plan, const Slot& slot, const residency::GpuReplica& copy,
                      const float* dq, float scale) {
  AttendArgs a;
  a.q = dq;
  a.hq = plan.q.hq;
  a.m = plan.q.m;
  a.d = plan.q.d;
  a.q_pos0 = plan.q.pos0;
  a.k = copy.block(0);
  a.v = copy.block(1);
  a.dtype = slot.dtype;
  // fp8: each block's row scales follow its e4m3 bytes (kernels::MakeTensor).
  a.k_scale = kernels::MakeTensor(a.k, slot.dtype, slot.heads, slot.rows, slot.d).scales;
  a.v_scale = kernels::MakeTensor(a.v, slot.dtype, slot.heads, slot.rows, slot.d).scales;
  a.heads = slot.heads;
  a.rows = slot.rows;
  a.k_pos0 = 0;
  a.begin = 0;
  a.end = slot.rows;
  a.scale = scale;
  a.window = plan.window;
  a.nrows = plan.q.hq * plan.q.m;
  return a;
}

// When one launch computes every part of the output rows in one split, it finishes itself
// (writes out/lse; no combine launch).
struct Finish {
  float* out = nullptr;
  float* lse = nullptr;
  bool done = false;  // set by the launch that took it over
};

Status TakeFinish(Job& job, AttendArgs* a, Finish* fin) {
  // With several splits the combine kernel merges faster than a launch's last blocks would
  // (measured on the H200): finish in the launch only when there is one split.
  if (fin == nullptr || a->splits != 1) return Status::Ok();
  auto counters = job.ctx()->Counters(kernels::cuda::GridBlocks(*a));
  if (!counters.ok()) return counters.status();
  a->counters = counters.value();
  a->out = fin->out;
  a->lse = fin->lse;
  fin->done = true;
  return Status::Ok();
}

// Uploads `items`, points `a` at the next `splits` parts and launches (flushing what is staged).
Status LaunchItems(Job& job, AttendArgs a, const std::vector<Item>& items, Parts* parts,
                   uint32_t splits, Finish* fin) {
  PION_ASSIGN(ditems, job.Up(items.data(), items.size()));
  a.items = ditems;
  a.n_items = static_cast<uint32_t>(items.size());
  a.item_rows = kernels::cuda::MaxRows(items);
  a.uniform_group = kernels::cuda::UniformGroup(items, a.m);
  a.splits = splits;
  a.part_m = parts->m;
  a.part_l = parts->l;
  a.part_o = parts->o;
  a.part0 = parts->count;
  parts->count += splits;
  PION_TRY(TakeFinish(job, &a, fin));
  PION_TRY(job.Flush());
  return kernels::cuda::LaunchAttend(a, job.stream());
}

// A dense pass of every query row of `a` (rows grouped by K/V head, padded to the tensor-core
// block's row groups), planned once: its items and splits (0 when no row sees a key).
struct DensePass {
  std::vector<Item> items;
  uint32_t splits = 0;
};

// `keys` is how many keys any row sees.
DensePass PlanDense(AttendArgs a, const int32_t* head_map, uint64_t keys) {
  DensePass pass;
  if (keys == 0) return pass;
  a.dense_items = true;
  const int pad = kernels::cuda::UsesTensorCores(a) ? kernels::cuda::FlashRowGroups(a) : 1;
  pass.items = kernels::cuda::DenseItems(a.hq, a.m, head_map, pad);
  a.n_items = static_cast<uint32_t>(pass.items.size());
  a.item_rows = kernels::cuda::MaxRows(pass.items);
  a.uniform_group = kernels::cuda::UniformGroup(pass.items, a.m);  // as LaunchItems sets it
  pass.splits = kernels::cuda::PlanSplits(a, keys);
  return pass;
}

// Launches a planned dense pass over keys [0, a.rows) of `a`, writing its splits into parts.
Status DenseLaunch(Job& job, AttendArgs a, const DensePass& pass, Parts* parts,
                   Finish* fin = nullptr) {
  if (pass.splits == 0) return Status::Ok();
  a.dense_items = true;
  return LaunchItems(job, a, pass.items, parts, pass.splits, fin);
}

// A sparse pass: row r attends list[r*stride ..+counts[r]) (device), one item per row.
Status SparseLaunch(Job& job, AttendArgs a, const int32_t* head_map, const int32_t* list,
                    const int32_t* counts, uint32_t stride, Parts* parts, uint32_t splits,
                    Finish* fin = nullptr) {
  a.dense_items = false;
  a.list = list;
  a.counts = counts;
  a.stride = stride;
  return LaunchItems(job, a, kernels::cuda::RowItems(a.hq, a.m, head_map), parts, splits, fin);
}

uint32_t SparseSplitsFor(AttendArgs a, const int32_t* head_map, uint32_t stride) {
  a.dense_items = false;
  a.list = reinterpret_cast<const int32_t*>(1);  // shape only: any sparse launch
  a.n_items = a.hq * a.m;
  return std::max<uint32_t>(1, kernels::cuda::PlanSplits(a, stride));
}

}  // namespace

Status RunGpu(Plan plan, const Slot& slot, const residency::GpuReplica& copy, Summaries* summaries,
              float* out, float* lse, Receipt* r) {
  if (IsMla(plan.form) || slot.mla) {
    // MLA slots stay in host memory (the family never gives them a GPU copy) and are computed
    // by the CPU kernel; a CUDA MLA kernel is issue 52's next step. Never a per-head kernel.
    return Error("MLA attention has no CUDA kernel yet: MLA slots are computed on the CPU");
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto ctx = gpu::Context::ForThisThread();
  if (!ctx.ok()) return ctx.status();
  Job job(ctx.value());
  kernels::Queries& q = plan.q;
  const float scale = plan.scale > 0 ? plan.scale : 1.0f / std::sqrt(static_cast<float>(q.d));
  const uint32_t n = slot.rows;
  const uint32_t s_suf = plan.k_suffix.rows;
  const bool fused = plan.form == Form::kFused || plan.form == Form::kSparseAutoFused;
  if (fused) q.pos0 = static_cast<int64_t>(n) + s_suf - q.m;
  const uint32_t nrows = q.hq * q.m;
  *r = Receipt{};
  r->support.assign(q.hq, 0);
  std::vector<uint64_t> visible(nrows);
  for (uint32_t row = 0; row < nrows; ++row) {
    visible[row] = VisibleCount(q.pos0 + static_cast<int64_t>(row % q.m), plan.window, n);
    r->visible_rows += visible[row];
  }

  // The copy's bytes are complete before any kernel of this stream reads them.
  PION_TRY(copy.ready().WaitOn(job.stream()));
  PION_ASSIGN(dq, job.Up(q.q, size_t{nrows} * q.d));
  PION_ASSIGN(dmap, job.Up(q.head_map, q.hq));
  AttendArgs base = PrefixArgs(plan, slot, copy, dq, scale);
  const auto [vis_lo, vis_hi] = VisibleRows(q.pos0, q.pos0 + q.m - 1, plan.window, 0, n);

  // Suffix (fused forms): fp32 K/V at positions N..N+S−1, dense and causal.
  AttendArgs suf = base;
  DensePass suf_pass;
  if (fused && s_suf > 0) {
    const size_t elems = size_t{plan.k_suffix.heads} * s_suf * q.d;
    PION_ASSIGN(dk, job.Up(static_cast<const float*>(plan.k_suffix.data), elems));
    PION_ASSIGN(dv, job.Up(static_cast<const float*>(plan.v_suffix.data), elems));
    suf.k = dk;
    suf.v = dv;
    suf.dtype = kernels::DType::kF32;
    suf.k_scale = suf.v_scale = nullptr;
    suf.rows = s_suf;
    suf.k_pos0 = n;
    suf.begin = 0;
    suf.end = s_suf;
    const auto [sb, se] = VisibleRows(q.pos0, q.pos0 + q.m - 1, plan.window, n, s_suf);
    suf_pass = PlanDense(suf, q.head_map, se - sb);
  }

  Parts parts;
  // Output then LSE, back to back: one download. Forms with a single attention launch (all but
  // the fused ones) finish in that launch.
  const size_t out_n = size_t{nrows} * q.d;
  // A small result (a decode step's rows) is written by the last kernel straight into pinned
  // host memory: no download call and transfer after it. Larger ones go through device memory
  // and one download (the kernel's scattered writes over PCIe would be slower).
  const bool direct = (out_n + nrows) * sizeof(float) <= kDirectResultBytes;
  PION_ASSIGN(dout, direct ? job.Mapped<float>(out_n + nrows) : job.Dev<float>(out_n + nrows));
  Finish finish{dout, dout + out_n};
  Finish* fin = fused ? nullptr : &finish;
  // Device results the receipt reads back.
  const int32_t* h_counts = nullptr;
  const float* h_omitted = nullptr;
  const uint8_t* h_exact = nullptr;
  const int32_t* h_blocks = nullptr;
  const int32_t* h_nchosen = nullptr;
  const float* h_ub = nullptr;      // sparse-auto with mass_bound: Quest's bound per head and block
  const float* h_scores = nullptr;  // AUDIT (M = 1): every row's exact scores [hq][n]
  uint32_t top_k = 0, b_lo = 0, b_hi = 0;

  switch (plan.form) {
    case Form::kDense:
    case Form::kFused: {
      // A decode step over a short range (no suffix): one launch, a thread-block cluster per
      // K/V head that attends and merges (decode_cluster.cu), where the device takes it.
      kernels::cuda::DecodeClusterArgs c;
      if (q.m == 1 && !fused && vis_lo < vis_hi) {
        c.group = kernels::cuda::GroupMembers(q.hq, q.head_map, slot.heads, c.members);
      }
      if (c.group > 0 &&
          kernels::cuda::DecodeClusterFits(slot.dtype, q.d, c.group, slot.heads, vis_hi - vis_lo)) {
        c.q = dq;
        c.hq = q.hq;
        c.d = q.d;
        c.k = copy.block(0);
        c.v = copy.block(1);
        c.dtype = slot.dtype;
        c.heads = slot.heads;
        c.rows = slot.rows;
        c.lo = static_cast<uint32_t>(vis_lo);
        c.hi = static_cast<uint32_t>(vis_hi);
        c.scale = scale;
        c.out = dout;
        c.lse = dout + out_n;
        PION_TRY(job.Flush());
        PION_TRY(kernels::cuda::LaunchDecodeCluster(c, job.stream()));
        finish.done = true;
        r->splits = kernels::cuda::kDecodeCluster;
      } else {
        const DensePass pass = PlanDense(base, q.head_map, vis_hi - vis_lo);
        PION_TRY(AllocParts(job, pass.splits + suf_pass.splits, nrows, q.d, &parts));
        PION_TRY(DenseLaunch(job, base, pass, &parts, fin));
        r->splits = std::max<uint32_t>(pass.splits, 1);
      }
      r->rows_attended = r->visible_rows;
      for (uint32_t row = 0; row < nrows; ++row) r->support[row / q.m] += visible[row];
      break;
    }
    case Form::kTopK: {
      top_k = std::min(plan.top_k, n);
      PION_ASSIGN(list, job.Dev<int32_t>(size_t{nrows} * top_k));
      PION_ASSIGN(counts, job.Dev<int32_t>(nrows));
      PION_ASSIGN(omitted, job.Dev<float>(nrows));
      PION_ASSIGN(exact, job.Dev<uint8_t>(nrows));
      // Scores in chunks of rows (at most 64 MiB of scores at a time).
      const uint32_t chunk = static_cast<uint32_t>(
          std::clamp<uint64_t>((64ull << 20) / (4ull * std::max(n, 1u)), 1, nrows));
      PION_ASSIGN(scores, job.Dev<float>(size_t{chunk} * n));
      PION_TRY(job.Flush());
      for (uint32_t row0 = 0; row0 < nrows; row0 += chunk) {
        const uint32_t cn = std::min(chunk, nrows - row0);
        PION_TRY(kernels::cuda::LaunchScores(base, dmap, row0, cn, scores, job.stream()));
        PION_TRY(kernels::cuda::LaunchSelectRows(base, row0, cn, scores, top_k, list, counts,
                                                 omitted, exact, job.stream()));
      }
      const uint32_t splits = SparseSplitsFor(base, q.head_map, top_k);
      PION_TRY(AllocParts(job, splits, nrows, q.d, &parts));
      PION_TRY(SparseLaunch(job, base, q.head_map, list, counts, top_k, &parts, splits, fin));
      r->splits = splits;
      PION_ASSIGN(hc, job.Down(counts, nrows));
      PION_ASSIGN(ho, job.Down(omitted, nrows));
      PION_ASSIGN(he, job.Down(exact, nrows));
      h_counts = hc, h_omitted = ho, h_exact = he;
      break;
    }
    case Form::kSparse: {
      PION_ASSIGN(list, job.Up(plan.rows, size_t{q.hq} * plan.stride));
      PION_ASSIGN(counts, job.Up(plan.counts, q.hq));
      const uint32_t splits = SparseSplitsFor(base, q.head_map, plan.stride);
      PION_TRY(AllocParts(job, splits, nrows, q.d, &parts));
      PION_TRY(SparseLaunch(job, base, q.head_map, list, counts, plan.stride, &parts, splits, fin));
      r->splits = splits;
      if (plan.audit && q.m == 1 && vis_lo < vis_hi) {
        PION_ASSIGN(scores, job.Dev<float>(size_t{q.hq} * n));
        PION_TRY(kernels::cuda::LaunchScores(base, dmap, 0, q.hq, scores, job.stream()));
        PION_ASSIGN_TO(h_scores, job.Down(scores, size_t{q.hq} * n));
      }
      for (uint32_t h = 0; h < q.hq; ++h) {
        uint64_t seen = 0;
        for (int32_t j = 0; j < plan.counts[h]; ++j) {
          const int32_t t = plan.rows[size_t{h} * plan.stride + j];
          if (t >= static_cast<int32_t>(vis_lo) && t < static_cast<int32_t>(vis_hi)) ++seen;
        }
        r->support[h] = seen;
        r->rows_attended += seen;
        if (seen < vis_hi - vis_lo) r->exact = false;
      }
      break;
    }
    case Form::kSparseAuto:
    case Form::kSparseAutoFused: {
      const uint32_t nb = summaries->nblocks, B = summaries->block;
      std::call_once(summaries->filled, [&] {
        summaries->fill_status = kernels::cuda::LaunchSummarize(
            copy.block(0), slot.dtype, base.k_scale, slot.heads, slot.rows, slot.d, B, nb,
            const_cast<float*>(summaries->dev_mean()), const_cast<float*>(summaries->dev_min()),
            const_cast<float*>(summaries->dev_max()), job.stream());
        if (summaries->fill_status.ok()) summaries->fill_status = job.ctx()->Sync();
        summaries->ready.store(summaries->fill_status.ok(), std::memory_order_release);
      });
      PION_TRY(summaries->fill_status);
      PION_TRY(job.Flush());
      PION_ASSIGN(blocks, job.Dev<int32_t>(size_t{q.hq} * (plan.k_top + 2)));
      PION_ASSIGN(nchosen, job.Dev<int32_t>(q.hq));
      PION_ASSIGN(counts, job.Dev<int32_t>(q.hq));
      PION_ASSIGN(omitted, job.Dev<float>(q.hq));
      if (vis_lo < vis_hi) {
        b_lo = vis_lo / B;
        b_hi = (vis_hi - 1) / B;
      }
      // The receipt's omitted_mass_bound: each head's own Quest bound per block (whatever the
      // selector ranked by), read back with the receipt's numbers.
      float* dub = nullptr;
      float* dscores = nullptr;
      if (plan.audit && q.m == 1 && vis_lo < vis_hi) {
        PION_ASSIGN(scores, job.Dev<float>(size_t{q.hq} * n));
        PION_TRY(kernels::cuda::LaunchScores(base, dmap, 0, q.hq, scores, job.stream()));
        dscores = scores;
      }
      if (plan.mass_bound && q.m == 1 && vis_lo < vis_hi) {
        PION_ASSIGN(ub, job.Dev<float>(size_t{q.hq} * nb));
        PION_ASSIGN(ub_mean, job.Dev<float>(size_t{q.hq} * nb));
        PION_TRY(kernels::cuda::LaunchScoreBlocks(
            dq, q.hq, q.d, dmap, summaries->dev_mean(), summaries->dev_min(), summaries->dev_max(),
            nb, kernels::BlockSelector::kQuest, ub, ub_mean, job.stream()));
        dub = ub;
      }
      // SHARED without a suffix, where the one-launch kernel takes the shape: score, select,
      // attend and merge in the thread-block clusters of each K/V head (sparse_fused.cu). With
      // one query head per K/V head, choosing per head is choosing per group: the same launch.
      kernels::cuda::FusedSparseArgs f;
      const uint32_t group =
          q.m == 1 ? kernels::cuda::GroupMembers(q.hq, q.head_map, slot.heads, f.members) : 0;
      const bool one_launch =
          vis_lo < vis_hi && plan.recent == 0 && (plan.shared_blocks || group == 1) &&
          fin != nullptr &&
          kernels::cuda::SparseAutoSharedFits(slot.dtype, q.d, group,
                                              static_cast<uint32_t>(b_hi - b_lo + 1), slot.heads);
      if (one_launch) {
        f.q = dq;
        f.hq = q.hq;
        f.d = q.d;
        f.k = copy.block(0);
        f.v = copy.block(1);
        f.heads = slot.heads;
        f.rows = slot.rows;
        f.mean = summaries->dev_mean();
        f.min = summaries->dev_min();
        f.max = summaries->dev_max();
        f.nb = nb;
        f.block = B;
        f.lo = static_cast<uint32_t>(vis_lo);
        f.hi = static_cast<uint32_t>(vis_hi);
        f.k_top = plan.k_top;
        f.scale = scale;
        f.quest = plan.selector == kernels::BlockSelector::kQuest;
        f.out = dout;
        f.lse = dout + out_n;
        f.blocks = blocks;
        f.nchosen = nchosen;
        f.counts = counts;
        f.omitted = omitted;
        f.cluster = kernels::cuda::SparseAutoSharedCluster(q.d, slot.heads);
        PION_TRY(job.Flush());
        PION_TRY(kernels::cuda::LaunchSparseAutoShared(f, job.stream()));
        finish.done = true;
        r->splits = f.cluster;
      } else {
        // Four launches: block scores, block select (writing each row's list), the lists'
        // partials, and the combine after this switch.
        const uint32_t stride =
            static_cast<uint32_t>(std::min<uint64_t>(uint64_t{plan.k_top + 2} * B, n));
        PION_ASSIGN(sel, job.Dev<float>(size_t{q.hq} * nb));
        PION_ASSIGN(ms, job.Dev<float>(size_t{q.hq} * nb));
        PION_ASSIGN(list, job.Dev<int32_t>(size_t{q.hq} * stride));
        // SHARED: one list per row group of a K/V head — a dense pass's items over the list of
        // each group's first row (the lists of a group's rows are equal).
        AttendArgs grouped = base;
        grouped.list = list;
        grouped.counts = counts;
        grouped.stride = stride;
        DensePass group_pass;  // SHARED
        if (plan.shared_blocks) group_pass = PlanDense(grouped, q.head_map, stride);
        const uint32_t splits =
            plan.shared_blocks ? group_pass.splits : SparseSplitsFor(base, q.head_map, stride);
        PION_TRY(AllocParts(job, splits + suf_pass.splits, nrows, q.d, &parts));
        if (vis_lo < vis_hi) {
          // RECENT: the blocks before the last visible one score +inf (always chosen).
          const auto [force_lo, force_hi] = RecentBlocks(b_lo, b_hi, plan.recent);
          PION_TRY(kernels::cuda::LaunchScoreBlocks(
              dq, q.hq, q.d, dmap, summaries->dev_mean(), summaries->dev_min(),
              summaries->dev_max(), nb, plan.selector, sel, ms, job.stream(), force_lo, force_hi));
          // SHARED: each head ranks the blocks by its group's highest scores.
          PION_TRY(kernels::cuda::LaunchSelectBlocks(
              sel, ms, dmap, q.hq, plan.shared_blocks, nb, B, vis_lo, vis_hi, plan.k_top, scale,
              blocks, nchosen, list, counts, stride, omitted, job.stream()));
          if (plan.shared_blocks) {
            PION_TRY(DenseLaunch(job, grouped, group_pass, &parts, fin));
          } else {
            PION_TRY(
                SparseLaunch(job, base, q.head_map, list, counts, stride, &parts, splits, fin));
          }
          r->splits = splits;
        }
      }
      if (vis_lo < vis_hi) {  // the receipt's numbers, as the selection wrote them
        PION_ASSIGN(hb, job.Down(blocks, size_t{q.hq} * (plan.k_top + 2)));
        PION_ASSIGN(hn, job.Down(nchosen, q.hq));
        PION_ASSIGN(hc, job.Down(counts, q.hq));
        PION_ASSIGN(ho, job.Down(omitted, q.hq));
        h_blocks = hb, h_nchosen = hn, h_counts = hc, h_omitted = ho;
        if (dub != nullptr) PION_ASSIGN_TO(h_ub, job.Down(dub, size_t{q.hq} * nb));
        if (dscores != nullptr) PION_ASSIGN_TO(h_scores, job.Down(dscores, size_t{q.hq} * n));
      }
      break;
    }
  }

  if (fused && suf_pass.splits > 0) {
    if (parts.m == nullptr) PION_TRY(AllocParts(job, suf_pass.splits, nrows, q.d, &parts));
    PION_TRY(DenseLaunch(job, suf, suf_pass, &parts));
  }
  if (parts.m == nullptr) PION_TRY(AllocParts(job, 0, nrows, q.d, &parts));
  PION_TRY(job.Flush());
  if (!finish.done) {
    PION_TRY(kernels::cuda::LaunchCombine(parts.count, nrows, q.d, parts.m, parts.l, parts.o, dout,
                                          dout + out_n, job.stream()));
  }
  const float* hout = dout;
  if (!direct) PION_ASSIGN_TO(hout, job.Down(dout, out_n + nrows));
  PION_TRY(job.ctx()->Sync());
  std::memcpy(out, hout, out_n * sizeof(float));
  if (lse != nullptr) std::memcpy(lse, hout + out_n, nrows * sizeof(float));

  // The receipt from what the selection kernels reported.
  if (plan.form == Form::kTopK) {
    double om = 0;
    for (uint32_t row = 0; row < nrows; ++row) {
      r->rows_attended += h_counts[row];
      r->support[row / q.m] += h_counts[row];
      r->exact = r->exact && h_exact[row];
      om += h_omitted[row];
    }
    r->omitted_mass_estimate = nrows ? om / nrows : 0;
    r->omitted_mass_bound = r->omitted_mass_estimate;  // exact scores: the share itself
  } else if (plan.form == Form::kSparseAuto || plan.form == Form::kSparseAutoFused) {
    r->blocks.assign(q.hq, {});
    double om = 0;
    if (h_blocks != nullptr) {
      r->blocks_total = b_hi - b_lo + 1;
      for (uint32_t h = 0; h < q.hq; ++h) {
        const int32_t* hb = h_blocks + size_t{h} * (plan.k_top + 2);
        r->blocks[h].assign(hb, hb + h_nchosen[h]);
        if (r->blocks[h].size() < r->blocks_total) r->exact = false;
        r->support[h] += h_counts[h];
        r->rows_attended += h_counts[h];
        om += h_omitted[h];
      }
    }
    r->omitted_mass_estimate = q.hq ? om / q.hq : 0;
    if (h_ub != nullptr) {  // each head's bound against all it attended (the final LSE)
      const float* row_lse = hout + out_n;
      double sum = 0;
      for (uint32_t h = 0; h < q.hq; ++h) {
        sum += OmittedMassBound(h_ub + size_t{h} * summaries->nblocks, r->blocks[h],
                                summaries->block, vis_lo, vis_hi, scale, row_lse[h]);
      }
      r->omitted_mass_bound = sum / q.hq;
    }
  } else if (plan.form == Form::kSparse) {
    r->omitted_mass_bound = r->exact ? 0 : 1;  // nothing scored the rows left out
  }
  if (plan.form == Form::kTopK) r->omitted_mass_exact = r->omitted_mass_estimate;
  if (h_scores != nullptr && !r->exact) {  // AUDIT: the exact share, every visible key scored
    const float* row_lse = hout + out_n;
    std::vector<uint8_t> kept(vis_hi - vis_lo);
    double sum = 0;
    for (uint32_t h = 0; h < q.hq; ++h) {
      std::fill(kept.begin(), kept.end(), 0);
      if (plan.form == Form::kSparse) {
        for (int32_t j = 0; j < plan.counts[h]; ++j) {
          const int64_t t = plan.rows[size_t{h} * plan.stride + j];
          if (t >= vis_lo && t < vis_hi) kept[t - vis_lo] = 1;
        }
      } else {
        for (uint32_t b : r->blocks[h]) {
          const uint64_t r0 = std::max<uint64_t>(uint64_t{b} * summaries->block, vis_lo);
          const uint64_t r1 = std::min<uint64_t>(uint64_t{b + 1} * summaries->block, vis_hi);
          for (uint64_t t = r0; t < r1; ++t) kept[t - vis_lo] = 1;
        }
      }
      const float* sc = h_scores + size_t{h} * n + vis_lo;  // row h's visible scores
      sum += ShareLeftOut(LogSumExpLeftOut(sc, kept.data(), kept.size()), row_lse[h]);
    }
    r->omitted_mass_exact = sum / q.hq;
  }
  if (fused) {
    for (uint32_t row = 0; row < nrows; ++row) {
      const int64_t p = q.pos0 + static_cast<int64_t>(row % q.m);
      auto [b, e] = VisibleFor(p, plan.window, n, s_suf);
      r->rows_attended += e - b;
      r->visible_rows += e - b;
      r->support[row / q.m] += e - b;
    }
  }
  r->micros =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  return Status::Ok();
}

}  // namespace pion::attention
