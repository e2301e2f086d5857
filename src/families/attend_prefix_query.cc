// ATTEND.PREFIX.QUERY* — attention over a resident slot (Stage 2). Each handler parses and
// validates on the slot's shard (every size mismatch names the expected and received sizes),
// takes a reference to the slot (so a concurrent STORE or eviction cannot change what it
// reads), and hands the computation to the compute pool; the reply follows when it is done.
// A full compute queue answers -BUSY. The math is attention::Run over kernels::AttentionKernels.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>

#include "attention/executor.h"
#include "attention/gpu_executor.h"
#include "families/args.h"
#include "families/attend_prefix_internal.h"
#include "server/server.h"

namespace pion::families::attend {
namespace {

using attention::Form;
using proto::CmdArgs;
using server::CommandContext;

}  // namespace

// `admission`: the DEADLINE / ALLOW APPROX options the command also takes, for the error.
Status ParseTail(const CmdArgs& args, size_t i, bool allow_qpos, bool allow_select,
                 bool allow_audit, std::string_view admission, Tail* t) {
  if (i < args.size()) {
    int64_t w;
    if (ParseInt64(args[i], &w)) {
      if (w < 0) return Error("fa_window must be >= 0 (0 = no window), got " + std::to_string(w));
      t->window = std::min(w, kMaxPosition);  // wider than every position: the same mask
      ++i;
    }
  }
  std::string expected = allow_audit ? "RECEIPT, AUDIT" : "RECEIPT";
  if (allow_qpos) expected = "QPOS, " + expected;
  if (allow_select) expected = "SELECT, SHARED, RECENT, " + expected;
  expected += admission;
  for (; i < args.size(); ++i) {
    if (EqualsIgnoreCase(args[i], "RECEIPT")) {
      t->receipt = true;
    } else if (allow_audit && EqualsIgnoreCase(args[i], "AUDIT")) {
      t->receipt = t->audit = true;
    } else if (allow_qpos && EqualsIgnoreCase(args[i], "QPOS")) {
      if (i + 1 >= args.size()) return Error("QPOS needs a position");
      int64_t p;
      if (!ParseInt64(args[i + 1], &p) || p < 0 || p > kMaxPosition) {
        return Error("QPOS must be an integer in [0, 2^62], got '" +
                     std::string(args[i + 1].substr(0, 32)) + "'");
      }
      t->qpos = p;
      ++i;
    } else if (allow_select && EqualsIgnoreCase(args[i], "SELECT")) {
      if (i + 1 >= args.size()) return Error("SELECT needs mean or quest");
      if (EqualsIgnoreCase(args[i + 1], "MEAN")) {
        t->selector = kernels::BlockSelector::kMean;
      } else if (EqualsIgnoreCase(args[i + 1], "QUEST")) {
        t->selector = kernels::BlockSelector::kQuest;
      } else {
        return Error("SELECT must be mean or quest, got '" +
                     std::string(args[i + 1].substr(0, 32)) + "'");
      }
      ++i;
    } else if (allow_select && EqualsIgnoreCase(args[i], "SHARED")) {
      t->shared = true;
    } else if (allow_select && EqualsIgnoreCase(args[i], "RECENT")) {
      uint64_t r = 0;
      if (i + 1 >= args.size() || !ParseUint(args[i + 1], "RECENT", &r).ok() || r > kMaxRows) {
        return Error("RECENT needs a whole number of blocks in [0, " + std::to_string(kMaxRows) +
                     "], got '" +
                     std::string(i + 1 < args.size() ? args[i + 1].substr(0, 32) : "") + "'");
      }
      t->recent = static_cast<uint32_t>(r);
      ++i;
    } else {
      return Error("unexpected argument '" + std::string(args[i].substr(0, 32)) +
                   "'; expected [<fa_window>] then any of " + expected);
    }
  }
  return Status::Ok();
}

// Takes argument i as a Buffer the job keeps (adopted when it was received into its own).
Status CheckIndexLists(const int32_t* rows, const int32_t* counts, uint32_t lists, uint32_t kmax,
                       uint32_t n, std::string_view owner) {
  std::vector<uint64_t> seen((n + 63) / 64);
  for (uint32_t i = 0; i < lists; ++i) {
    if (counts[i] < 0 || static_cast<uint32_t>(counts[i]) > kmax) {
      return Error("counts[" + std::to_string(i) + "] = " + std::to_string(counts[i]) +
                   " is not in [0, K_sparse_max=" + std::to_string(kmax) + "]");
    }
    std::fill(seen.begin(), seen.end(), 0);
    for (int32_t j = 0; j < counts[i]; ++j) {
      const int32_t t = rows[static_cast<size_t>(i) * kmax + j];
      const std::string at = "indices[" + std::to_string(i) + "][" + std::to_string(j) + "] = ";
      if (t < 0 || static_cast<uint32_t>(t) >= n) {
        return Error(at + std::to_string(t) + " is out of range [0, N=" + std::to_string(n) + ")");
      }
      uint64_t& word = seen[t / 64];
      const uint64_t bit = uint64_t{1} << (t % 64);
      if (word & bit) {
        return Error(at + std::to_string(t) + " repeats an earlier index of " + std::string(owner) +
                     " " + std::to_string(i));
      }
      word |= bit;
    }
  }
  return Status::Ok();
}

StatusOr<BufferRef> Take(CmdArgs& args, size_t i, QueryJob* job) {
  auto b = args.TakeBuffer(i);
  if (!b.ok()) return b.status();
  job->hold.push_back(b.value());
  return b;
}

std::string Shape(std::initializer_list<std::pair<const char*, uint64_t>> dims) {
  std::string s = "(";
  for (const auto& [name, v] : dims) {
    if (s.size() > 1) s += " ";
    s += std::string(name) + "=" + std::to_string(v);
  }
  return s + ")";
}

namespace {

// Checks the slot against the command's D and K/V heads.
Status CheckSlot(const attention::Slot& slot, uint32_t d, std::optional<uint32_t> h_kv) {
  if (d != slot.d) {
    return Error("D " + std::to_string(d) + " does not match the slot's head_dim " +
                 std::to_string(slot.d));
  }
  if (h_kv && *h_kv != slot.heads) {
    return Error("H_kv " + std::to_string(*h_kv) + " does not match the slot's " +
                 std::to_string(slot.heads) + " K/V heads");
  }
  return Status::Ok();
}

// Forms without a head_map: H must be a multiple of the slot's K/V heads, and query head h
// reads K/V head h / (H / H_kv).
Status ContiguousHeadMap(const attention::Slot& slot, uint32_t hq, QueryJob* job) {
  if (hq % slot.heads != 0) {
    return Error("H " + std::to_string(hq) + " is not a multiple of the slot's " +
                 std::to_string(slot.heads) + " K/V heads (contiguous GQA grouping)");
  }
  const uint32_t group = hq / slot.heads;
  for (uint32_t i = 0; i < hq; ++i) job->head_map.push_back(static_cast<int32_t>(i / group));
  return Status::Ok();
}

// head_map: int32 [H_q], each in [0, H_kv).
Status CheckHeadMap(const BufferRef& b, uint32_t hq, uint32_t h_kv, QueryJob* job) {
  Status s =
      CheckBlobSize("head_map", "H_q*4 " + Shape({{"H_q", hq}}), uint64_t{hq} * 4, b->size());
  if (!s.ok()) return s;
  job->head_map.assign(As<int32_t>(b), As<int32_t>(b) + hq);
  for (uint32_t h = 0; h < hq; ++h) {
    if (job->head_map[h] < 0 || static_cast<uint32_t>(job->head_map[h]) >= h_kv) {
      return Error("head_map[" + std::to_string(h) + "] = " + std::to_string(job->head_map[h]) +
                   " is not a K/V head in [0, " + std::to_string(h_kv) + ")");
    }
  }
  return Status::Ok();
}

// M from a Q blob of H*M*D fp32.
Status DeriveM(const BufferRef& q, uint32_t h, uint32_t d, uint32_t* m) {
  const uint64_t row = uint64_t{h} * d * 4;
  if (q->size() == 0 || q->size() % row != 0) {
    return Error("Q_blob must be H*M*D*4 bytes " + Shape({{"H", h}, {"D", d}}) +
                 ", a non-zero multiple of " + std::to_string(row) + ", got " +
                 std::to_string(q->size()));
  }
  if (q->size() / row > kMaxRows) return Error("M must be at most " + std::to_string(kMaxRows));
  *m = static_cast<uint32_t>(q->size() / row);
  return Status::Ok();
}

// Suffix K/V [H_kv][S][D] fp32.
Status TakeSuffix(CmdArgs& args, size_t ki, uint32_t h_kv, uint32_t s_suf, uint32_t d,
                  QueryJob* job) {
  const uint64_t bytes = uint64_t{h_kv} * s_suf * d * 4;
  const std::string formula =
      "H_kv*S_suf*D*4 " + Shape({{"H_kv", h_kv}, {"S_suf", s_suf}, {"D", d}});
  Status s = CheckBlobSize("K_suf", formula, bytes, args[ki].size());
  if (s.ok()) s = CheckBlobSize("V_suf", formula, bytes, args[ki + 1].size());
  if (!s.ok()) return s;
  auto k = Take(args, ki, job);
  if (!k.ok()) return k.status();
  auto v = Take(args, ki + 1, job);
  if (!v.ok()) return v.status();
  job->plan.k_suffix = {k.value()->data(), kernels::DType::kF32, h_kv, s_suf, d};
  job->plan.v_suffix = {v.value()->data(), kernels::DType::kF32, h_kv, s_suf, d};
  return Status::Ok();
}

void WriteReceipt(proto::ReplyBuilder& rb, const QueryJob& job, const attention::Receipt& r,
                  std::string_view backend) {
  const bool auto_form =
      job.plan.form == Form::kSparseAuto || job.plan.form == Form::kSparseAutoFused;
  rb.Map((auto_form ? 25 : 22) + (job.audit ? 1 : 0));
  rb.Bulk("exact");
  rb.Bool(r.exact);
  rb.Bulk("form");
  rb.Bulk(attention::FormName(job.plan.form));
  rb.Bulk("backend");
  rb.Bulk(job.gpu ? backend : std::string_view("cpu"));
  rb.Bulk("tier");  // where the K/V were read from
  rb.Bulk(job.tier);
  rb.Bulk("fallback");  // "" or why the answer came from elsewhere than asked
  rb.Bulk(job.fallback);
  rb.Bulk("dtype");
  rb.Bulk(job.slot->dtype_name());
  rb.Bulk("generation");
  rb.Integer(static_cast<int64_t>(job.slot->generation));
  rb.Bulk("prefix_rows");
  rb.Integer(job.slot->rows);
  rb.Bulk("suffix_rows");
  rb.Integer(attention::IsMla(job.plan.form) ? job.plan.latent_suffix.rows
                                             : job.plan.k_suffix.rows);
  rb.Bulk("query_rows");
  rb.Integer(static_cast<int64_t>(uint64_t{job.plan.q.hq} * job.plan.q.m));
  rb.Bulk("rows_attended");
  rb.Integer(static_cast<int64_t>(r.rows_attended));
  rb.Bulk("visible_rows");
  rb.Integer(static_cast<int64_t>(r.visible_rows));
  rb.Bulk("support");
  rb.Array(r.support.size());
  for (uint64_t s : r.support) rb.Integer(static_cast<int64_t>(s));
  if (auto_form) {
    rb.Bulk("blocks_total");
    rb.Integer(r.blocks_total);
    uint64_t chosen = 0;
    for (const auto& b : r.blocks) chosen += b.size();
    rb.Bulk("blocks_chosen");
    rb.Integer(static_cast<int64_t>(chosen));
    rb.Bulk("blocks");
    rb.Array(r.blocks.size());
    for (const auto& head : r.blocks) {
      rb.Array(head.size());
      for (uint32_t b : head) rb.Integer(b);
    }
  }
  rb.Bulk("omitted_mass_estimate");
  rb.Double(r.omitted_mass_estimate, 6);
  rb.Bulk("omitted_mass_bound");  // never below the true share (PROTOCOL.md): rounded up
  rb.Double(std::min(1.0, std::ceil(r.omitted_mass_bound * 1e6) / 1e6), 6);
  if (job.audit) {  // AUDIT: every visible key scored
    rb.Bulk("omitted_mass_exact");
    rb.Double(r.omitted_mass_exact, 6);
  }
  rb.Bulk("splits");
  rb.Integer(r.splits);
  rb.Bulk("micros");
  rb.Double(r.micros, 3);
  rb.Bulk("queue_us");  // handed to the compute pool -> a compute thread started it
  rb.Double(r.queue_us, 3);
  rb.Bulk("piece_start_max_us");
  rb.Double(r.piece_start_max_us, 3);
  rb.Bulk("piece_max_us");
  rb.Double(r.piece_max_us, 3);
  rb.Bulk("merge_us");
  rb.Double(r.merge_us, 3);
  rb.Bulk("estimate_us");  // what the cost model expected of the computation (0: no estimate)
  rb.Double(r.estimate_us, 3);
}

// What a query produced: status, output (+ LSE) and receipt.
struct QueryResult {
  Status status;
  BufferRef out;
  std::shared_ptr<attention::Receipt> receipt;
};

// Runs the job on this thread (splits through `par`) and counts it.
QueryResult Execute(server::Server* srv, const QueryJob& job, const attention::Parallel& par) {
  const kernels::AttentionKernels& kern = Kernels(*srv);
  const attention::Slot& slot = *job.slot;
  if (job.deadline != residency::kNoDeadline && residency::Clock::now() > job.deadline) {
    // It waited in the queue past its deadline: nothing computed, the answer would be late.
    srv->residency()->CountRefusal(residency::Stage::kCompute, residency::Refusal::kDeadline);
    QueryResult late;
    late.status =
        Status(ErrorKind::kTimeout, "deadline passed while the query waited for a compute thread");
    return late;
  }
  const auto started = std::chrono::steady_clock::now();
  double summarize_us = 0;  // part of the computation: counted in the receipt's micros
  if (job.summaries && !job.gpu) {
    std::call_once(job.summaries->filled, [&] {
      const auto t0 = std::chrono::steady_clock::now();
      attention::Summarize(kern, par, slot.Tensor(job.k), job.summaries->View(slot.heads, slot.d));
      job.summaries->ready.store(true, std::memory_order_release);
      summarize_us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  QueryResult res;
  const size_t d = slot.mla ? slot.dv : job.plan.q.d;  // an output row's width
  const size_t bytes = (job.out_rows * d + (job.with_lse ? job.out_rows : 0)) * sizeof(float);
  auto out = BufferAllocator::Default()->Allocate(bytes);
  if (!out.ok()) {
    res.status = out.status();
    return res;
  }
  res.out = std::move(out).value();
  float* o = reinterpret_cast<float*>(res.out->data());
  float* lse = job.with_lse ? o + job.out_rows * d : nullptr;
  res.receipt = std::make_shared<attention::Receipt>();
  attention::Receipt* r = res.receipt.get();

  if (slot.mla) {  // latent rows: the CPU kernel under every backend
    res.status = attention::RunMla(kern, par, job.plan, slot.LatentView(job.k), o, lse, r);
  } else if (job.gpu) {
    // The replica is pinned by the job: it stays on the GPU until the job is done.
    res.status = attention::RunGpu(job.plan, slot, **job.gpu, job.summaries.get(), o, lse, r);
  } else {
    res.status =
        attention::Run(kern, par, job.plan, slot.Tensor(job.k), slot.Tensor(job.v), o, lse, r);
  }
  if (job.submitted) {  // after Run, which starts the receipt afresh
    r->queue_us = std::chrono::duration<double, std::micro>(started - *job.submitted).count();
  }
  r->micros += summarize_us;
  r->estimate_us = job.estimate * 1e6;
  auto& c = srv->attention_counters();
  if (res.status.ok()) c.cost.Record(job.key, job.work, r->micros * 1e-6);
  c.queries[static_cast<int>(job.plan.form)].fetch_add(1, std::memory_order_relaxed);
  (r->exact ? c.exact : c.approximate).fetch_add(1, std::memory_order_relaxed);
  c.rows_attended.fetch_add(r->rows_attended, std::memory_order_relaxed);
  c.compute_us.fetch_add(static_cast<uint64_t>(r->micros), std::memory_order_relaxed);
  return res;
}

void WriteResult(proto::ReplyBuilder& rb, const QueryJob& job, const QueryResult& res,
                 std::string_view backend) {
  if (!res.status.ok()) return rb.Error(res.status);
  if (job.receipt) rb.Array(2);
  rb.BulkRef(res.out);
  if (job.receipt) WriteReceipt(rb, job, *res.receipt, backend);
}

// Queries this small (multiply-adds, attention::WorkOf) run on the shard's own thread: handing
// them to the compute pool and the reply back costs more than computing them. Host memory:
// ~tens of µs on one core. GPU slots: the kernels take a few µs and the fixed costs of a launch
// (staging, one upload, one download, a stream sync: ~tens of µs) dominate, so the GPU bound is
// higher; the shard thread waits on its own stream, no other shard's.
constexpr double kInlineMacs = double{1 << 20};
constexpr double kInlineGpuMacs = double{1 << 24};

// The job's work as the cost model counts it, and where it runs (attention/cost_model.h).
void CostJob(server::Server& srv, QueryJob* job) {
  const attention::Slot& slot = *job->slot;
  const bool summarized = job->summaries == nullptr || job->summaries->ready.load();
  job->work = attention::WorkOf(job->plan, slot.rows, slot.heads, slot.dtype, summarized);
  job->inline_run = job->work.macs <= (job->gpu ? kInlineGpuMacs : kInlineMacs);
  job->key = attention::KeyOf(job->gpu != nullptr, job->plan, slot.dtype, job->inline_run);
  job->estimate = srv.attention_counters().cost.Estimate(job->key, job->work).value_or(0);
}

// How a job on the compute pool splits its work (ParallelFor on the pool); inline: one thread.
attention::Parallel ParallelOf(server::Server& srv, bool inline_run) {
  if (inline_run) return attention::Parallel{};
  server::WorkerPool* pool = srv.compute();
  return attention::Parallel{
      pool->threads(),
      [pool](size_t n, const std::function<void(size_t)>& fn) { pool->ParallelFor(n, fn); }};
}

// A CPU key nothing has measured yet is measured now, once (a few ms of the kernels over
// synthetic K/V of the job's shape), so a deadline is judged by this machine's rate.
void MeasureIfNew(server::Server& srv, const QueryJob& job) {
  attention::CostModel& model = srv.attention_counters().cost;
  // MLA forms are estimated from their own runs only (CalibrateCpu knows per-head forms).
  if (job.key.gpu || attention::IsMla(job.plan.form) || model.Measured(job.key)) return;
  attention::CalibrateCpu(model, Kernels(srv), ParallelOf(srv, job.inline_run), job.key,
                          job.plan.q.hq, job.slot->heads, job.plan.q.d, job.plan.q.m);
}

// Brings the slot's K/V where the job computes — the GPU under the cuda backend, host memory
// for the CPU kernels — promoting it (the command parks and runs again) when it was demoted, and
// holds them for the job. A deadline the GPU promotion cannot meet, on a slot whose bytes are
// in host memory, computes on the CPU there instead: the same exact attention, told in the
// receipt (tier host, fallback). False when the command was parked or refused.
bool HoldBytes(CommandContext& ctx, QueryJob* job) {
  const attention::Slot& slot = *job->slot;
  residency::Engine* engine = ctx.server->residency();
  if (slot.mla) {  // one latent block, in host memory under every backend
    if (!ctx.Resident({slot.obj}, residency::Tier::kHost)) {
      ctx.server->attention_counters().promotions.fetch_add(1, std::memory_order_relaxed);
      return false;  // parked: the slot comes back from disk, then the query runs again
    }
    if (ctx.server->gpu_attention()) {
      job->fallback =
          "cpu: no CUDA MLA kernel yet; MLA slots stay in host memory and are "
          "computed on the CPU";
    }
    job->k = slot.obj->HostBlock(0);
    return static_cast<bool>(job->k);
  }
  if (slot.gpu) {
    bool on_gpu = slot.obj->Resident(residency::Tier::kGpu);
    if (!on_gpu && ctx.deadline != residency::kNoDeadline &&
        slot.obj->Resident(residency::Tier::kHost)) {
      const double left =
          std::chrono::duration<double>(ctx.deadline - residency::Clock::now()).count();
      const double est = engine->EstimateSeconds({slot.obj}, residency::Tier::kGpu);
      if (est > left) {
        job->k = slot.obj->HostBlock(0);
        job->v = slot.obj->HostBlock(1);
        if (job->k && job->v) {
          char why[160];
          std::snprintf(why, sizeof(why),
                        "cpu: promotion to the GPU estimated %.1f ms, %.1f ms left of the deadline",
                        est * 1e3, left * 1e3);
          job->fallback = why;
          job->tier = "host";
          ctx.server->attention_counters().cpu_fallbacks.fetch_add(1, std::memory_order_relaxed);
          if (job->summaries && !job->summaries->mean.empty()) return true;
          if (job->summaries) {  // GPU summaries: the CPU needs its own for this job
            job->summaries = std::make_shared<attention::Summaries>();
            job->summaries->block = job->plan.block;
            job->summaries->nblocks = (slot.rows + job->plan.block - 1) / job->plan.block;
            const size_t n = size_t{slot.heads} * job->summaries->nblocks * slot.d;
            job->summaries->mean.resize(n);
            job->summaries->min.resize(n);
            job->summaries->max.resize(n);
            job->plan.summaries = job->summaries->View(slot.heads, slot.d);
          }
          return true;
        }
      }
    }
    if (!ctx.Resident({slot.obj}, residency::Tier::kGpu)) {
      ctx.server->attention_counters().promotions.fetch_add(1, std::memory_order_relaxed);
      return false;  // parked: the slot comes back to the GPU, then the query runs again
    }
    job->gpu = std::make_shared<residency::GpuPin>(slot.obj->Gpu());
    job->tier = "gpu";
    return static_cast<bool>(*job->gpu);
  }
  if (!ctx.Resident({slot.obj}, residency::Tier::kHost)) {
    ctx.server->attention_counters().promotions.fetch_add(1, std::memory_order_relaxed);
    return false;  // parked: the slot comes back from disk, then the query runs again
  }
  job->k = slot.obj->HostBlock(0);
  job->v = slot.obj->HostBlock(1);
  return job->k && job->v;
}

// The typed fallback of a dense decode step that cannot meet its deadline and whose caller
// allows it (ALLOW APPROX): sparse-auto over the K_top best 64-row blocks (plus the first and
// last; SHARED, so a K/V head group reads each chosen row once), K_top as large as the time left
// allows — and only when that is estimated to finish sooner than the exact answer. The receipt
// says so (exact 0, the form, the omitted-mass estimate, fallback). False when no K_top does.
bool MakeApproximate(CommandContext& ctx, QueryJob* job, double left, double dense_seconds) {
  const attention::Slot& slot = *job->slot;
  server::Server& srv = *ctx.server;
  constexpr uint32_t kBlock = 64;
  std::shared_ptr<attention::Summaries> summaries;
  if (job->gpu) {
    auto s = slot.SummariesFor(kBlock, srv.gpu_budget());
    if (!s.ok()) return false;
    summaries = std::move(s).value();
  } else if (!slot.gpu) {
    auto s = slot.SummariesFor(kBlock, srv.residency()->host_budget(residency::Family::kAttention));
    if (!s.ok()) return false;
    summaries = std::move(s).value();
  } else {  // a GPU slot computed on the CPU: summaries of its own for this job
    summaries = std::make_shared<attention::Summaries>();
    summaries->block = kBlock;
    summaries->nblocks = (slot.rows + kBlock - 1) / kBlock;
    const size_t n = size_t{slot.heads} * summaries->nblocks * slot.d;
    summaries->mean.resize(n);
    summaries->min.resize(n);
    summaries->max.resize(n);
  }
  attention::Plan sparse = job->plan;
  sparse.form = Form::kSparseAuto;
  sparse.block = kBlock;
  sparse.selector = kernels::BlockSelector::kMean;
  sparse.shared_blocks = true;
  QueryJob probe;  // the sparse job's key, for a measurement if it has none yet
  probe.slot = job->slot;
  probe.plan = sparse;
  probe.plan.k_top = std::max<uint32_t>(1, summaries->nblocks / 8);
  probe.gpu = job->gpu;
  probe.summaries = summaries;
  CostJob(srv, &probe);
  probe.inline_run = false;  // a pass long enough to miss a deadline runs on the pool
  probe.key.inline_run = false;
  MeasureIfNew(srv, probe);
  const auto k_top = attention::AffordableTopK(srv.attention_counters().cost, probe.key, sparse,
                                               slot.rows, slot.heads, slot.dtype,
                                               summaries->ready.load(), left, dense_seconds);
  if (!k_top) return false;
  job->summaries = std::move(summaries);
  job->plan = sparse;
  job->plan.k_top = *k_top;
  job->plan.summaries = job->summaries->View(slot.heads, slot.d);
  job->with_lse = false;
  CostJob(srv, job);
  char why[240];
  std::snprintf(why, sizeof(why),
                "%s%sapprox: dense over %u rows estimated at %.2f ms would pass the deadline; "
                "sparse-auto over %u blocks of %u (SHARED), estimated at %.2f ms (ALLOW APPROX)",
                job->fallback.c_str(), job->fallback.empty() ? "" : "; ", slot.rows,
                dense_seconds * 1e3, job->plan.k_top, kBlock, job->estimate * 1e3);
  job->fallback = why;
  srv.attention_counters().approx_fallbacks.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// Admission against the request's deadline (seed 004 §0x08L, §0x09K): a query the compute
// stage cannot finish in time — its estimate from this machine's measured rate for its form
// and dtype, behind the work already queued — is refused now (-TIMEOUT naming the stage and the
// estimate), never queued to answer late; or, with ALLOW APPROX, a dense decode step is answered
// sparse with a receipt that says so, when that is estimated to come sooner. An exact request
// never becomes approximate by itself; with nothing comparable measured (a GPU form's first
// query) nothing is refused on a guess.
bool Admit(CommandContext& ctx, QueryJob* job) {
  job->deadline = ctx.deadline;
  CostJob(*ctx.server, job);
  if (ctx.deadline == residency::kNoDeadline) return true;
  MeasureIfNew(*ctx.server, *job);
  attention::CostModel& model = ctx.server->attention_counters().cost;
  const std::optional<double> est = model.Estimate(job->key, job->work);
  if (!est) return true;
  job->estimate = *est;
  const double left = std::chrono::duration<double>(ctx.deadline - residency::Clock::now()).count();
  const double wait = job->inline_run ? 0 : model.queued_seconds();
  if (wait + *est <= left) return true;
  const bool dense_decode =
      job->plan.form == Form::kDense && job->plan.q.m == 1 && job->plan.k_suffix.rows == 0;
  if (ctx.allow_approx && dense_decode && left - wait > 0 &&
      MakeApproximate(ctx, job, left - wait, *est)) {
    return true;
  }
  ctx.server->residency()->CountRefusal(residency::Stage::kCompute, residency::Refusal::kDeadline);
  char msg[320];
  std::snprintf(msg, sizeof(msg),
                "deadline cannot be met: %s attention is estimated at %.2f ms on the %s (compute "
                "stage, rate measured here for %s) after %.2f ms of queued work, %.2f ms left%s",
                std::string(attention::FormName(job->plan.form)).c_str(), *est * 1e3,
                job->gpu ? "gpu" : "cpu", job->key.Name().c_str(), wait * 1e3,
                std::max(0.0, left * 1e3),
                dense_decode && !ctx.allow_approx
                    ? "; ALLOW APPROX permits a sparse answer where one is faster"
                    : "");
  ctx.Error(Status(ErrorKind::kTimeout, msg));
  return false;
}

}  // namespace

void Submit(CommandContext& ctx, std::shared_ptr<QueryJob> job) {
  server::Server* srv = ctx.server;
  server::Shard* shard = ctx.shard;
  job->plan.mass_bound = job->receipt;  // its cost only where a receipt reports it
  job->plan.audit = job->audit;
  if (!HoldBytes(ctx, job.get())) return;  // parked (promoted, then run again) or refused
  if (!Admit(ctx, job.get())) return;      // the deadline cannot be met (and no fallback)
  if (job->inline_run) {
    const QueryResult res = Execute(srv, *job, attention::Parallel{});
    srv->attention_counters().inline_queries.fetch_add(1, std::memory_order_relaxed);
    return WriteResult(*ctx.rb, *job, res, BackendName(*srv));
  }
  auto reply = ctx.Defer();
  job->submitted = std::chrono::steady_clock::now();
  attention::CostModel& model = srv->attention_counters().cost;
  model.AddQueued(job->estimate);
  bool queued = srv->compute()->Submit([srv, job, reply]() {
    auto res = std::make_shared<QueryResult>(Execute(srv, *job, ParallelOf(*srv, false)));
    srv->attention_counters().cost.SubQueued(job->estimate);
    // The slot's bytes and the arguments are let go before the reply goes out (the reply needs
    // neither): a client's next command never finds them still held by this one.
    job->k.reset();
    job->v.reset();
    job->gpu.reset();
    job->hold.clear();
    const std::string_view backend = BackendName(*srv);
    reply([res, job, backend](proto::ReplyBuilder& rb) { WriteResult(rb, *job, *res, backend); });
  });
  if (!queued) model.SubQueued(job->estimate);
  if (!queued) {
    shard->stats().Reject(server::RejectReason::kBusy);
    const size_t depth = srv->compute()->queued();
    reply([depth](proto::ReplyBuilder& rb) {
      rb.Error(Status(ErrorKind::kBusy, "the compute queue is full (" + std::to_string(depth) +
                                            " queries waiting); retry later"));
    });
  }
}

namespace {

// Common head of every form: <sid> <layer> <H> <D>.
struct Head {
  attention::SlotRef slot;
  uint32_t layer = 0, hq = 0, d = 0;
};
Status ParseHead(CommandContext& ctx, const CmdArgs& args, Head* h) {
  Status s = ParseLayer(args[2], &h->layer);
  if (!s.ok()) return s;
  // A per-head form on an MLA slot: said first, whatever its H and D.
  if (attention::SlotRef slot = ctx.shard->store().attention.Find(ctx.Key(args[1]), h->layer);
      slot != nullptr && slot->mla) {
    return Error("the slot of session '" + std::string(args[1].substr(0, 128)) + "' layer " +
                 std::to_string(h->layer) + " holds MLA latents (kv_lora_rank " +
                 std::to_string(slot->dv) + " + rope_dim " + std::to_string(slot->d - slot->dv) +
                 ", one row per token for every head), not per-head K/V: query it with "
                 "ATTEND.PREFIX.QUERY_MLA, QUERY_MLA_SPARSE or QUERY_MLA_FUSED");
  }
  s = ParseCount(args[3], "H", kMaxHeads, &h->hq);
  if (s.ok()) s = ParseHeadDim(args[4], &h->d);
  if (!s.ok()) return s;
  auto slot = FindSlot(ctx, args[1], h->layer);
  if (!slot.ok()) return slot.status();
  h->slot = std::move(slot).value();
  return Status::Ok();
}

void SetQueries(QueryJob* job, const BufferRef& q, uint32_t hq, uint32_t m, uint32_t d) {
  job->plan.q.q = As<float>(q);
  job->plan.q.hq = hq;
  job->plan.q.m = m;
  job->plan.q.d = d;
  job->plan.q.head_map = job->head_map.data();
}

// ATTEND.PREFIX.QUERY <sid> <layer> <H> <D> <top_k> <Q_blob> [<fa_window>] [QPOS p] [RECEIPT]
void Query(CommandContext& ctx, CmdArgs& args) {
  Head h;
  Status s = ParseHead(ctx, args, &h);
  uint64_t top_k = 0;
  if (s.ok()) s = ParseUint(args[5], "top_k", &top_k);
  if (s.ok() && top_k > kMaxRows) s = Error("top_k must be at most " + std::to_string(kMaxRows));
  if (s.ok()) s = CheckSlot(*h.slot, h.d, std::nullopt);
  auto job = std::make_shared<QueryJob>();
  if (s.ok()) s = ContiguousHeadMap(*h.slot, h.hq, job.get());
  Tail tail;
  if (s.ok()) s = ParseTail(args, 7, true, false, true, AdmissionOptionsHint(ctx.spec), &tail);
  if (!s.ok()) return ctx.Error(s);
  auto q = Take(args, 6, job.get());
  if (!q.ok()) return ctx.Error(q.status());
  uint32_t m;
  s = DeriveM(q.value(), h.hq, h.d, &m);
  if (!s.ok()) return ctx.Error(s);
  job->slot = h.slot;
  SetQueries(job.get(), q.value(), h.hq, m, h.d);
  job->plan.form = top_k > 0 ? Form::kTopK : Form::kDense;
  job->plan.top_k = static_cast<uint32_t>(top_k);
  job->plan.window = tail.window;
  job->plan.q.pos0 = tail.qpos.value_or(h.slot->rows);
  job->out_rows = uint64_t{h.hq} * m;
  job->with_lse = m > 1;
  job->receipt = tail.receipt;
  job->audit = tail.audit;
  Submit(ctx, std::move(job));
}

// ATTEND.PREFIX.QUERY_FUSED <sid> <layer> <H_q> <D> <S_suf> <H_kv> <Q> <K_suf> <V_suf>
//   <head_map> [<fa_window>] [RECEIPT]
void QueryFused(CommandContext& ctx, CmdArgs& args) {
  Head h;
  uint32_t s_suf = 0, h_kv = 0;
  Status s = ParseHead(ctx, args, &h);
  if (s.ok()) s = ParseCount(args[5], "S_suf", kMaxRows, &s_suf);
  if (s.ok()) s = ParseCount(args[6], "H_kv", kMaxHeads, &h_kv);
  if (s.ok()) s = CheckSlot(*h.slot, h.d, h_kv);
  Tail tail;
  if (s.ok()) s = ParseTail(args, 11, false, false, true, AdmissionOptionsHint(ctx.spec), &tail);
  if (!s.ok()) return ctx.Error(s);
  auto job = std::make_shared<QueryJob>();
  auto q = Take(args, 7, job.get());
  uint32_t m = 0;
  s = q.ok() ? DeriveM(q.value(), h.hq, h.d, &m) : q.status();
  if (s.ok() && m > s_suf) {
    s = Error("M " + std::to_string(m) + " (from Q_blob) exceeds S_suf " + std::to_string(s_suf) +
              ": the queries are the last M suffix positions");
  }
  if (s.ok()) s = TakeSuffix(args, 8, h_kv, s_suf, h.d, job.get());
  auto map = s.ok() ? Take(args, 10, job.get()) : StatusOr<BufferRef>(s);
  if (s.ok()) s = map.ok() ? CheckHeadMap(map.value(), h.hq, h_kv, job.get()) : map.status();
  if (!s.ok()) return ctx.Error(s);
  job->slot = h.slot;
  SetQueries(job.get(), q.value(), h.hq, m, h.d);
  job->plan.form = Form::kFused;
  job->plan.window = tail.window;
  job->out_rows = uint64_t{h.hq} * m;
  job->receipt = tail.receipt;
  job->audit = tail.audit;
  Submit(ctx, std::move(job));
}

// ATTEND.PREFIX.QUERY_SPARSE <sid> <layer> <H> <D> <K_sparse_max> <Q> <indices> <counts>
//   [<fa_window>] [QPOS p] [RECEIPT]
void QuerySparse(CommandContext& ctx, CmdArgs& args) {
  Head h;
  uint32_t kmax = 0;
  Status s = ParseHead(ctx, args, &h);
  if (s.ok()) s = ParseCount(args[5], "K_sparse_max", kMaxRows, &kmax);
  if (s.ok()) s = CheckSlot(*h.slot, h.d, std::nullopt);
  auto job = std::make_shared<QueryJob>();
  if (s.ok()) s = ContiguousHeadMap(*h.slot, h.hq, job.get());
  Tail tail;
  if (s.ok()) s = ParseTail(args, 9, true, false, true, AdmissionOptionsHint(ctx.spec), &tail);
  if (s.ok()) {
    s = CheckBlobSize("Q_blob", "H*D*4 " + Shape({{"H", h.hq}, {"D", h.d}}),
                      uint64_t{h.hq} * h.d * 4, args[6].size());
  }
  if (s.ok()) {
    s = CheckBlobSize("indices", "H*K_sparse_max*4 " + Shape({{"H", h.hq}, {"K_sparse_max", kmax}}),
                      uint64_t{h.hq} * kmax * 4, args[7].size());
  }
  if (s.ok()) {
    s = CheckBlobSize("counts", "H*4 " + Shape({{"H", h.hq}}), uint64_t{h.hq} * 4, args[8].size());
  }
  if (!s.ok()) return ctx.Error(s);
  auto q = Take(args, 6, job.get());
  auto idx = Take(args, 7, job.get());
  auto cnt = Take(args, 8, job.get());
  if (!q.ok() || !idx.ok() || !cnt.ok()) {
    return ctx.Error(!q.ok() ? q.status() : !idx.ok() ? idx.status() : cnt.status());
  }
  const int32_t* rows = As<int32_t>(idx.value());
  const int32_t* counts = As<int32_t>(cnt.value());
  const uint32_t n = h.slot->rows;
  Status lists = CheckIndexLists(rows, counts, h.hq, kmax, n, "head");
  if (!lists.ok()) return ctx.Error(lists);
  job->slot = h.slot;
  SetQueries(job.get(), q.value(), h.hq, 1, h.d);
  job->plan.form = Form::kSparse;
  job->plan.rows = rows;
  job->plan.counts = counts;
  job->plan.stride = kmax;
  job->plan.window = tail.window;
  job->plan.q.pos0 = tail.qpos.value_or(n);
  job->out_rows = h.hq;
  job->receipt = tail.receipt;
  job->audit = tail.audit;
  Submit(ctx, std::move(job));
}

// ATTEND.PREFIX.QUERY_SPARSE_AUTO[_FUSED] <sid> <layer> <H_q> <D> <B> <K_top> <H_kv>
//   [<S_suf>] <Q> [<K_suf> <V_suf>] <head_map> [<fa_window>] [QPOS p] [SELECT mean|quest]
//   [SHARED] [RECENT blocks] [RECEIPT] [AUDIT]
void QuerySparseAutoImpl(CommandContext& ctx, CmdArgs& args, bool fused) {
  Head h;
  uint32_t block = 0, h_kv = 0, s_suf = 0;
  uint64_t k_top = 0;
  Status s = ParseHead(ctx, args, &h);
  if (s.ok()) s = ParseCount(args[5], "B", 1u << 20, &block);
  if (s.ok()) s = ParseUint(args[6], "K_top", &k_top);
  if (s.ok() && k_top > kMaxRows) s = Error("K_top must be at most " + std::to_string(kMaxRows));
  if (s.ok()) s = ParseCount(args[7], "H_kv", kMaxHeads, &h_kv);
  if (s.ok() && fused) s = ParseCount(args[8], "S_suf", kMaxRows, &s_suf);
  if (s.ok()) s = CheckSlot(*h.slot, h.d, h_kv);
  const size_t qi = fused ? 9 : 8, map_i = fused ? 12 : 9;
  Tail tail;
  if (s.ok())
    s = ParseTail(args, map_i + 1, !fused, true, true, AdmissionOptionsHint(ctx.spec), &tail);
  if (s.ok() && tail.recent > k_top) {
    s = Error("RECENT " + std::to_string(tail.recent) + " exceeds K_top " + std::to_string(k_top) +
              ": the recent blocks are among the K_top chosen");
  }
  if (s.ok()) {
    s = CheckBlobSize("Q_blob", "H_q*D*4 " + Shape({{"H_q", h.hq}, {"D", h.d}}),
                      uint64_t{h.hq} * h.d * 4, args[qi].size());
  }
  if (!s.ok()) return ctx.Error(s);
  auto job = std::make_shared<QueryJob>();
  auto q = Take(args, qi, job.get());
  if (!q.ok()) return ctx.Error(q.status());
  if (fused) s = TakeSuffix(args, 10, h_kv, s_suf, h.d, job.get());
  auto map = s.ok() ? Take(args, map_i, job.get()) : StatusOr<BufferRef>(s);
  if (s.ok()) s = map.ok() ? CheckHeadMap(map.value(), h.hq, h_kv, job.get()) : map.status();
  if (!s.ok()) return ctx.Error(s);
  auto summaries = h.slot->SummariesFor(
      block, h.slot->gpu ? ctx.server->gpu_budget()
                         : ctx.server->residency()->host_budget(residency::Family::kAttention));
  if (!summaries.ok()) return ctx.Error(summaries.status());
  job->summaries = std::move(summaries).value();
  job->slot = h.slot;
  SetQueries(job.get(), q.value(), h.hq, 1, h.d);
  job->plan.form = fused ? Form::kSparseAutoFused : Form::kSparseAuto;
  job->plan.block = block;
  job->plan.k_top = static_cast<uint32_t>(k_top);
  job->plan.selector = tail.selector;
  job->plan.shared_blocks = tail.shared;
  job->plan.recent = tail.recent;
  job->plan.summaries = job->summaries->View(h.slot->heads, h.slot->d);
  job->plan.window = tail.window;
  job->plan.q.pos0 = tail.qpos.value_or(h.slot->rows);
  job->out_rows = h.hq;
  job->receipt = tail.receipt;
  job->audit = tail.audit;
  Submit(ctx, std::move(job));
}

void QuerySparseAuto(CommandContext& ctx, CmdArgs& args) { QuerySparseAutoImpl(ctx, args, false); }
void QuerySparseAutoFused(CommandContext& ctx, CmdArgs& args) {
  QuerySparseAutoImpl(ctx, args, true);
}

}  // namespace

void RegisterQueryCommands(server::Server& srv) {
  RegisterMlaQueryCommands(srv);
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kRead = kCmdKvCache | kCmdReadOnly | kCmdDeadline | kCmdApprox;
  // The options after a form's arguments (ParseTail), which the dispatcher looks among for
  // DEADLINE and ALLOW APPROX.
  const std::vector<TrailingOption> kTail = {{"RECEIPT", 0}, {"AUDIT", 0},  {"QPOS", 1},
                                             {"SELECT", 1},  {"SHARED", 0}, {"RECENT", 1}};
  r.Register(WithOptions(
      {"ATTEND.PREFIX.QUERY", -7, kRead, 1, 1, 1, Query, "attend_prefix",
       "Attention of Q over the slot: M=1 -> H*D fp32; M>1 -> H*M*D fp32 then LSE H*M. "
       "top_k 0 = dense and exact.",
       "<sid> <layer> <H> <D> <top_k> <Q_blob> [<fa_window>] [QPOS <p>] [RECEIPT] [AUDIT]"},
      kTail));
  r.Register(
      WithOptions({"ATTEND.PREFIX.QUERY_FUSED", -11, kRead, 1, 1, 1, QueryFused, "attend_prefix",
                   "Prefix + causal suffix attention merged in one call; H_q*M*D fp32.",
                   "<sid> <layer> <H_q> <D> <S_suf> <H_kv> <Q> <K_suf> <V_suf> <head_map> "
                   "[<fa_window>] [RECEIPT] [AUDIT]"},
                  kTail));
  r.Register(
      WithOptions({"ATTEND.PREFIX.QUERY_SPARSE", -9, kRead, 1, 1, 1, QuerySparse, "attend_prefix",
                   "M=1 attention over caller-chosen rows per head; H*D fp32.",
                   "<sid> <layer> <H> <D> <K_sparse_max> <Q> <indices> <counts> [<fa_window>] "
                   "[QPOS <p>] [RECEIPT] [AUDIT]"},
                  kTail));
  r.Register(WithOptions(
      {"ATTEND.PREFIX.QUERY_SPARSE_AUTO", -10, kRead, 1, 1, 1, QuerySparseAuto, "attend_prefix",
       "M=1 attention over the K_top best blocks of B rows (+ first and last); H_q*D fp32.",
       "<sid> <layer> <H_q> <D> <B> <K_top> <H_kv> <Q> <head_map> [<fa_window>] "
       "[QPOS <p>] [SELECT mean|quest] [SHARED] [RECENT <blocks>] [RECEIPT] [AUDIT]"},
      kTail));
  r.Register(WithOptions(
      {"ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", -13, kRead, 1, 1, 1, QuerySparseAutoFused,
       "attend_prefix", "Sparse-auto over the prefix plus the dense suffix, merged; H_q*D fp32.",
       "<sid> <layer> <H_q> <D> <B> <K_top> <H_kv> <S_suf> <Q> <K_suf> <V_suf> <head_map> "
       "[<fa_window>] [SELECT mean|quest] [SHARED] [RECENT <blocks>] [RECEIPT] [AUDIT]"},
      kTail));
}

}  // namespace pion::families::attend
