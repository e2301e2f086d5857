// ATTEND.PREFIX.QUERY_MLA* — attention over an MLA slot (DeepSeek V2/V3's latent rows) in the
// absorbed formulation: each query head's row is its query already multiplied by W_UK
// (kv_lora_rank values) then its RoPE part (rope_dim), every head attends the same latent rows
// with the caller's softmax scale, and the reply is the softmax-weighted latents [H_q][M]
// [kv_lora_rank] (the caller applies W_UV) with their log-sum-exp, mergeable like every other
// Stage 2 reply. Forms: dense (decode, M = 1; MTP / speculative tokens, causal among themselves
// when they sit inside the rows), caller-sparse (token indices per query token: DeepSeek-V3.2's
// indexer), fused with the client's suffix latents. Each handler validates on the slot's shard
// and hands the job to attend_prefix_query.cc's Submit; the math is attention::RunMla.
#include <cmath>
#include <cstdio>
#include <cstring>

#include "families/args.h"
#include "families/attend_prefix_internal.h"
#include "server/server.h"

namespace pion::families::attend {
namespace {

using attention::Form;
using proto::CmdArgs;
using server::CommandContext;

// Query heads one MLA call takes (DeepSeek V3: 128), and query tokens (decode, MTP).
constexpr uint32_t kMaxMlaHeads = 128;
constexpr uint32_t kMaxMlaTokens = 64;

// Common head of every MLA form: <sid> <layer> <H_q> <kv_lora_rank> <rope_dim> <scale>.
struct MlaHead {
  attention::SlotRef slot;
  uint32_t layer = 0, hq = 0, dk = 0, dv = 0;
  float scale = 0;
};

Status ParseMlaHead(CommandContext& ctx, const CmdArgs& args, MlaHead* h) {
  uint32_t rank = 0;
  uint64_t rope = 0;
  Status s = ParseLayer(args[2], &h->layer);
  if (s.ok()) s = ParseCount(args[3], "H_q", kMaxMlaHeads, &h->hq);
  if (s.ok()) s = ParseCount(args[4], "kv_lora_rank", 4096, &rank);
  if (s.ok()) s = ParseUint(args[5], "rope_dim", &rope);
  if (!s.ok()) return s;
  const std::string text(args[6].substr(0, 32));
  char* end = nullptr;
  const double scale = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(scale) || !(scale > 0) ||
      !std::isfinite(static_cast<float>(scale))) {
    return Error(
        "scale must be a finite number > 0 (the softmax scale: DeepSeek's is "
        "1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times its YaRN mscale^2), got '" +
        text + "'");
  }
  h->scale = static_cast<float>(scale);
  auto slot = FindSlot(ctx, args[1], h->layer);
  if (!slot.ok()) return slot.status();
  h->slot = std::move(slot).value();
  const attention::Slot& sl = *h->slot;
  if (!sl.mla) {
    return Error("the slot of session '" + std::string(args[1].substr(0, 128)) + "' layer " +
                 std::to_string(h->layer) + " holds per-head K/V (" + std::to_string(sl.heads) +
                 " heads of " + std::to_string(sl.d) +
                 "), not MLA latents: store an MLA slot (ATTEND.PREFIX.STORE ... MLA ..., or FROM "
                 "an MLA namespace) or query it with ATTEND.PREFIX.QUERY");
  }
  if (rank != sl.dv || rope != sl.d - sl.dv) {
    return Error("kv_lora_rank " + std::to_string(rank) + " + rope_dim " + std::to_string(rope) +
                 " do not match the slot's kv_lora_rank " + std::to_string(sl.dv) + " + rope_dim " +
                 std::to_string(sl.d - sl.dv));
  }
  h->dk = sl.d;
  h->dv = sl.dv;
  return Status::Ok();
}

// M from Q_blob: H_q·M rows of kv_lora_rank + rope_dim fp32 values, M <= kMaxMlaTokens.
Status DeriveMlaM(const BufferRef& q, const MlaHead& h, uint32_t* m) {
  const uint64_t row = uint64_t{h.hq} * h.dk * 4;
  if (q->size() == 0 || q->size() % row != 0) {
    return Error("Q_blob must be H_q*M*(kv_lora_rank+rope_dim)*4 bytes " +
                 Shape({{"H_q", h.hq}, {"kv_lora_rank", h.dv}, {"rope_dim", h.dk - h.dv}}) +
                 ", a non-zero multiple of " + std::to_string(row) + ", got " +
                 std::to_string(q->size()));
  }
  if (q->size() / row > kMaxMlaTokens) {
    return Error("M " + std::to_string(q->size() / row) + " (from Q_blob) exceeds " +
                 std::to_string(kMaxMlaTokens) +
                 ": an MLA call takes up to 64 query tokens (decode, MTP / speculative)");
  }
  *m = static_cast<uint32_t>(q->size() / row);
  return Status::Ok();
}

void SetMlaQueries(QueryJob* job, const MlaHead& h, const BufferRef& q, uint32_t m, Form form) {
  job->slot = h.slot;
  job->plan.form = form;
  job->plan.q.q = As<float>(q);
  job->plan.q.hq = h.hq;
  job->plan.q.m = m;
  job->plan.q.d = h.dk;
  job->plan.dv = h.dv;
  job->plan.scale = h.scale;
  job->out_rows = uint64_t{h.hq} * m;
  job->with_lse = true;  // every MLA reply carries its LSE: the client merges its suffix
}

// ATTEND.PREFIX.QUERY_MLA <sid> <layer> <H_q> <kv_lora_rank> <rope_dim> <scale> <Q_blob>
//   [<fa_window>] [QPOS <p>] [RECEIPT]
void QueryMla(CommandContext& ctx, CmdArgs& args) {
  MlaHead h;
  Status s = ParseMlaHead(ctx, args, &h);
  Tail tail;
  if (s.ok()) s = ParseTail(args, 8, true, false, false, AdmissionOptionsHint(ctx.spec), &tail);
  if (!s.ok()) return ctx.Error(s);
  auto job = std::make_shared<QueryJob>();
  auto q = Take(args, 7, job.get());
  uint32_t m = 0;
  s = q.ok() ? DeriveMlaM(q.value(), h, &m) : q.status();
  if (!s.ok()) return ctx.Error(s);
  SetMlaQueries(job.get(), h, q.value(), m, Form::kMla);
  job->plan.window = tail.window;
  job->plan.q.pos0 = tail.qpos.value_or(h.slot->rows);
  job->receipt = tail.receipt;
  Submit(ctx, std::move(job));
}

// ATTEND.PREFIX.QUERY_MLA_SPARSE <sid> <layer> <H_q> <kv_lora_rank> <rope_dim> <scale>
//   <K_sparse_max> <Q_blob> <indices> <counts> [<fa_window>] [QPOS <p>] [RECEIPT]
// indices int32 [M][K_sparse_max], counts int32 [M]: query token i (all its heads) attends rows
// indices[i][0 .. counts[i]).
void QueryMlaSparse(CommandContext& ctx, CmdArgs& args) {
  MlaHead h;
  uint32_t kmax = 0;
  Status s = ParseMlaHead(ctx, args, &h);
  if (s.ok()) s = ParseCount(args[7], "K_sparse_max", kMaxRows, &kmax);
  Tail tail;
  if (s.ok()) s = ParseTail(args, 11, true, false, false, AdmissionOptionsHint(ctx.spec), &tail);
  if (!s.ok()) return ctx.Error(s);
  auto job = std::make_shared<QueryJob>();
  auto q = Take(args, 8, job.get());
  uint32_t m = 0;
  s = q.ok() ? DeriveMlaM(q.value(), h, &m) : q.status();
  if (s.ok()) {
    s = CheckBlobSize("indices", "M*K_sparse_max*4 " + Shape({{"M", m}, {"K_sparse_max", kmax}}),
                      uint64_t{m} * kmax * 4, args[9].size());
  }
  if (s.ok()) {
    s = CheckBlobSize("counts", "M*4 " + Shape({{"M", m}}), uint64_t{m} * 4, args[10].size());
  }
  if (!s.ok()) return ctx.Error(s);
  auto idx = Take(args, 9, job.get());
  auto cnt = Take(args, 10, job.get());
  if (!idx.ok() || !cnt.ok()) return ctx.Error(!idx.ok() ? idx.status() : cnt.status());
  const int32_t* rows = As<int32_t>(idx.value());
  const int32_t* counts = As<int32_t>(cnt.value());
  const uint32_t n = h.slot->rows;
  Status lists = CheckIndexLists(rows, counts, m, kmax, n, "token");
  if (!lists.ok()) return ctx.Error(lists);
  SetMlaQueries(job.get(), h, q.value(), m, Form::kMlaSparse);
  job->plan.rows = rows;
  job->plan.counts = counts;
  job->plan.stride = kmax;
  job->plan.window = tail.window;
  job->plan.q.pos0 = tail.qpos.value_or(n);
  job->receipt = tail.receipt;
  Submit(ctx, std::move(job));
}

// ATTEND.PREFIX.QUERY_MLA_FUSED <sid> <layer> <H_q> <kv_lora_rank> <rope_dim> <scale> <S_suf>
//   <Q_blob> <C_suf> [<fa_window>] [RECEIPT]
// C_suf fp32 [S_suf][kv_lora_rank + rope_dim]: the client's latents after the prefix; the M
// queries are the last M of them, attending the prefix and the suffix causally.
void QueryMlaFused(CommandContext& ctx, CmdArgs& args) {
  MlaHead h;
  uint32_t s_suf = 0;
  Status s = ParseMlaHead(ctx, args, &h);
  if (s.ok()) s = ParseCount(args[7], "S_suf", kMaxRows, &s_suf);
  Tail tail;
  if (s.ok()) s = ParseTail(args, 10, false, false, false, AdmissionOptionsHint(ctx.spec), &tail);
  if (!s.ok()) return ctx.Error(s);
  auto job = std::make_shared<QueryJob>();
  auto q = Take(args, 8, job.get());
  uint32_t m = 0;
  s = q.ok() ? DeriveMlaM(q.value(), h, &m) : q.status();
  if (s.ok() && m > s_suf) {
    s = Error("M " + std::to_string(m) + " (from Q_blob) exceeds S_suf " + std::to_string(s_suf) +
              ": the queries are the last M suffix positions");
  }
  if (s.ok()) {
    s = CheckBlobSize(
        "C_suf",
        "S_suf*(kv_lora_rank+rope_dim)*4 " +
            Shape({{"S_suf", s_suf}, {"kv_lora_rank", h.dv}, {"rope_dim", h.dk - h.dv}}),
        uint64_t{s_suf} * h.dk * 4, args[9].size());
  }
  if (!s.ok()) return ctx.Error(s);
  auto c = Take(args, 9, job.get());
  if (!c.ok()) return ctx.Error(c.status());
  SetMlaQueries(job.get(), h, q.value(), m, Form::kMlaFused);
  job->plan.latent_suffix = {c.value()->data(), kernels::LatentType::kF32, s_suf, h.dk, h.dv};
  job->plan.window = tail.window;
  job->receipt = tail.receipt;
  Submit(ctx, std::move(job));
}

}  // namespace

void RegisterMlaQueryCommands(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  // No ALLOW APPROX: an MLA query is never answered approximately in its place.
  constexpr uint32_t kRead = kCmdKvCache | kCmdReadOnly | kCmdDeadline;
  const std::vector<TrailingOption> kTail = {{"RECEIPT", 0}, {"QPOS", 1}};
  r.Register(WithOptions(
      {"ATTEND.PREFIX.QUERY_MLA", -8, kRead, 1, 1, 1, QueryMla, "attend_prefix",
       "MLA (absorbed) attention of H_q heads over an MLA slot's latent rows: H_q*M*kv_lora_rank "
       "fp32 then LSE H_q*M.",
       "<sid> <layer> <H_q> <kv_lora_rank> <rope_dim> <scale> <Q_blob> [<fa_window>] "
       "[QPOS <p>] [RECEIPT]"},
      kTail));
  r.Register(WithOptions(
      {"ATTEND.PREFIX.QUERY_MLA_SPARSE", -11, kRead, 1, 1, 1, QueryMlaSparse, "attend_prefix",
       "MLA attention over caller-chosen latent rows per query token (DeepSeek-V3.2's sparse "
       "attention); output then LSE.",
       "<sid> <layer> <H_q> <kv_lora_rank> <rope_dim> <scale> <K_sparse_max> <Q_blob> <indices> "
       "<counts> [<fa_window>] [QPOS <p>] [RECEIPT]"},
      kTail));
  r.Register(WithOptions(
      {"ATTEND.PREFIX.QUERY_MLA_FUSED", -10, kRead, 1, 1, 1, QueryMlaFused, "attend_prefix",
       "MLA attention over the slot's latents and the client's suffix latents, merged; output "
       "then LSE.",
       "<sid> <layer> <H_q> <kv_lora_rank> <rope_dim> <scale> <S_suf> <Q_blob> <C_suf> "
       "[<fa_window>] [RECEIPT]"},
      kTail));
}

}  // namespace pion::families::attend
