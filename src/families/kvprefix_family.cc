// KV.PREFIX.* — shared prefix K/V namespaces. REGISTER creates the namespace's identity
// manifest and its V-store sessions "<ns>_pk"/"<ns>_pv" (an MLA namespace: its latent session
// "<ns>_pl"); clients write layers with
// V.STOREBATCH and read them with V.FETCH RANGE. LOOKUP answers HIT only for a complete prefix
// whose identity matches (a half-written prefix is never a hit); INFO/BLOCKS/MEMBERSHIP/OWNER
// describe it; DROP deletes it and fences its generation.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <optional>

#include "cluster/key_slot.h"
#include "families/args.h"
#include "families/cluster_internal.h"
#include "families/families.h"
#include "families/kvprefix_internal.h"
#include "families/shard_sum.h"
#include "net/connection.h"
#include "server/server.h"
#include "store/disk/object_file.h"
#include "store/prefix_object.h"

namespace pion::families {
namespace kvprefix {

PrefixSessions SessionsOf(server::Shard& shard, uint32_t tenant, std::string_view ns,
                          const store::PrefixManifest& m) {
  auto& vs = shard.store().vstore;
  PrefixSessions out;
  size_t n = 0;
  for (std::string_view suffix : m.SessionSuffixes()) {
    auto* e = vs.Find(store::TenantKey{tenant, std::string(ns) + std::string(suffix)});
    if (e == nullptr || e->session->dim() != m.dim() || e->session->codec().format() != m.format) {
      return PrefixSessions{};
    }
    out.parts[n++] = e->session.get();
  }
  out.count = n;
  return out;
}

bool Complete(const PrefixSessions& s, const store::PrefixManifest& m) {
  int64_t n = static_cast<int64_t>(m.rows());
  if (!s.ok()) return false;
  for (const store::VSession* sess : s.all()) {
    if (!sess->RangeWritten(0, n)) return false;
  }
  return true;
}

bool Published(server::Shard& shard, uint32_t tenant, std::string_view ns, store::PrefixEntry* e) {
  if (e->publication > 0) return true;
  if (!e->resident) return e->saved_complete;  // complete on disk; published when opened
  const PrefixSessions s = SessionsOf(shard, tenant, ns, e->manifest);
  const uint64_t n = e->manifest.rows();
  // rows() counts distinct ids written: fewer than n in any session cannot be complete.
  if (!s.ok()) return false;
  for (const store::VSession* sess : s.all()) {
    if (sess->rows() < n) return false;
  }
  if (!Complete(s, e->manifest)) return false;
  shard.store().prefixes.Publish(e);
  return true;
}

Status PublishedRefusal(std::string_view ns, const store::PrefixEntry& e, std::string_view what) {
  const std::string name(ns.substr(0, 128));
  return Status(ErrorKind::kReadOnly,
                std::string(what) + " refused: namespace '" + name +
                    "' is published (complete at cache_generation " +
                    std::to_string(e.manifest.cache_generation) +
                    ") and its K/V never change under readers; to publish other K/V, "
                    "KV.PREFIX.DROP '" +
                    name +
                    "' and KV.PREFIX.REGISTER it again (a new generation), or use another "
                    "namespace");
}

Status CheckLayoutSession(std::string_view sid, const store::PrefixManifest& m) {
  const std::string_view ns = sid.substr(0, sid.size() - 3), suffix = sid.substr(ns.size());
  for (std::string_view s : m.SessionSuffixes()) {
    if (s == suffix) return Status::Ok();
  }
  const std::string name(sid.substr(0, 128));
  return Status(ErrorKind::kMismatch,
                "namespace '" + std::string(ns.substr(0, 128)) + "' holds " + m.DescribeLayout(ns) +
                    ", so '" + name + "' is not one of its sessions: " +
                    (m.mla() ? "a per-head reader cannot read an MLA namespace (read its latent "
                               "rows from '" +
                                   std::string(ns.substr(0, 128)) + "_pl')"
                             : "an MLA reader cannot read a per-head namespace"));
}

Status CheckRows(std::string_view ns, const store::PrefixManifest& m, int64_t lo, int64_t hi) {
  const int64_t n = static_cast<int64_t>(m.rows());
  if (lo >= 0 && hi <= n) return Status::Ok();
  const int64_t bad = lo < 0 ? lo : hi - 1;
  return Error("row " + std::to_string(bad) + " is outside namespace '" +
               std::string(ns.substr(0, 128)) + "': its sessions hold rows [0, " +
               std::to_string(n) + ") = n_layers " + std::to_string(m.n_layers) + " x n_tokens " +
               std::to_string(m.n_tokens) + " (row = layer*n_tokens + token); nothing stored");
}

Status Intact(server::Server& srv, const store::TenantKey& ns, store::PrefixEntry* e,
              const PrefixSessions& s) {
  bool lost = false;
  for (const store::VSession* sess : s.all()) lost = lost || sess->lost_chunks() > 0;
  if (e->corrupt.empty() && lost) {
    std::string why;  // the first lost chunk's own words (once per namespace)
    for (const store::VSession* sess : s.all()) {
      for (const auto& [i, c] : sess->chunks()) {
        if (why.empty()) why = c->obj->lost();
      }
    }
    e->corrupt = "namespace '" + ns.name +
                 "' has a chunk whose only copy failed validation and is not served: " + why;
    srv.disk_stats().objects_corrupt.fetch_add(1);
    spdlog::error(
        "disk tier: prefix '{}' is corrupt and will not be served: a chunk failed "
        "validation",
        ns.name);
  }
  if (!e->corrupt.empty()) return Status(ErrorKind::kCorrupt, e->corrupt);
  return Status::Ok();
}

}  // namespace kvprefix

namespace {

using kvprefix::PrefixSessions;
using proto::CmdArgs;
using server::CommandContext;
using store::PrefixEntry;
using store::PrefixManifest;

constexpr uint32_t kBlockTokens = 64;

PrefixSessions SessionsOf(CommandContext& ctx, std::string_view ns, const PrefixManifest& m) {
  return kvprefix::SessionsOf(*ctx.shard, ctx.tenant, ns, m);
}
using kvprefix::Complete;

// The committed frontier (seed 004 §0x04G): the largest t such that tokens [0, t) of every
// layer are written in both K and V.
uint64_t CommittedFrontier(const PrefixSessions& s, const PrefixManifest& m) {
  const uint64_t T = m.n_tokens;
  for (uint64_t t0 = 0; t0 < T; t0 += kBlockTokens) {
    const uint64_t block = std::min<uint64_t>(kBlockTokens, T - t0);
    uint64_t head = block;  // the shortest written run from t0, over layers and K/V
    for (uint64_t l = 0; l < m.n_layers && head > 0; ++l) {
      for (const store::VSession* sess : s.all()) {
        const int64_t a = static_cast<int64_t>(l * T + t0);
        if (sess->CountWritten(a, a + static_cast<int64_t>(head)) == head) continue;
        uint64_t h = 0;
        while (h < head && sess->RangeWritten(a + h, a + h + 1)) ++h;
        head = h;
      }
    }
    if (head < block) return t0 + head;
  }
  return T;
}

Status ParseDim(std::string_view text, const char* what, uint32_t max, uint32_t* out) {
  uint64_t v = 0;
  Status s = ParseUint(text, what, &v);
  if (!s.ok()) return s;
  if (v == 0 || v > max) {
    return Error(std::string(what) + " must be in [1, " + std::to_string(max) + "], got " +
                 std::to_string(v));
  }
  *out = static_cast<uint32_t>(v);
  return Status::Ok();
}

// The layout arguments: <kv_heads> <head_dim>, or MLA <kv_lora_rank> <rope_dim>; `next` is
// the index of the format argument after them.
Status ParseLayout(const CmdArgs& args, PrefixManifest* m, size_t* next) {
  if (!EqualsIgnoreCase(args[4], "MLA")) {
    Status s = ParseDim(args[4], "kv_heads", 1024, &m->kv_heads);
    if (s.ok()) s = ParseDim(args[5], "head_dim", 4096, &m->head_dim);
    *next = 6;
    return s;
  }
  if (args.size() < 8) {
    return Error(
        "syntax: KV.PREFIX.REGISTER <ns> <n_layers> <n_tokens> MLA <kv_lora_rank> "
        "<rope_dim> <format> [MODEL <id>] [POSITION <digest>] [PREFILL_MS <ms>]");
  }
  m->layout = store::PrefixLayout::kMla;
  Status s = ParseDim(args[5], "kv_lora_rank", 4096, &m->kv_lora_rank);
  uint64_t rope = 0;
  if (s.ok()) s = ParseUint(args[6], "rope_dim", &rope);
  if (s.ok() && rope > 1024)
    s = Error("rope_dim must be in [0, 1024], got " + std::to_string(rope));
  if (!s.ok()) return s;
  m->rope_dim = static_cast<uint32_t>(rope);
  m->kv_heads = 1;  // one latent row per token, shared by every head
  m->head_dim = m->kv_lora_rank + m->rope_dim;
  *next = 7;
  return Status::Ok();
}

// The codecs of each layout: fp8_ds_mla is DeepSeek-V3.2's latent row (kv_lora_rank a multiple
// of 128, then 64 RoPE values), so only MLA namespaces of that shape take it; MLA latents are
// stored in the float and fp8 formats the MLA kernels read.
Status CheckLayoutFormat(const PrefixManifest& m) {
  using codec::Format;
  if (!m.mla()) {
    if (m.format == Format::kFp8DsMla) {
      return Error(
          "fp8_ds_mla is the MLA latent layout: register the namespace with MLA <kv_lora_rank> "
          "<rope_dim> (kv_heads/head_dim namespaces hold per-head K/V)");
    }
    return Status::Ok();
  }
  const Format f = m.format;
  if (f != Format::kFp32 && f != Format::kFp16 && f != Format::kBf16 && f != Format::kFp8 &&
      f != Format::kFp8DsMla) {
    return Error(
        "an MLA namespace stores its latents as fp32, fp16, bf16, fp8 or fp8_ds_mla, got '" +
        std::string(codec::FormatName(f)) + "'");
  }
  if (f == Format::kFp8DsMla &&
      (m.rope_dim != codec::kDsMlaRope || m.kv_lora_rank % codec::kDsMlaGroup != 0)) {
    return Error(
        "fp8_ds_mla holds kv_lora_rank (a multiple of 128) + 64 RoPE values, got "
        "kv_lora_rank " +
        std::to_string(m.kv_lora_rank) + " rope_dim " + std::to_string(m.rope_dim));
  }
  return Status::Ok();
}

// KV.PREFIX.REGISTER <ns> <n_layers> <n_tokens> (<kv_heads> <head_dim> | MLA <kv_lora_rank>
//   <rope_dim>) <format> [MODEL <id>] [POSITION <digest>] [PREFILL_MS <ms>]
void Register(CommandContext& ctx, CmdArgs& args) {
  PrefixManifest m;
  size_t fi = 6;
  Status s = ParseDim(args[2], "n_layers", 4096, &m.n_layers);
  if (s.ok()) s = ParseDim(args[3], "n_tokens", 1u << 28, &m.n_tokens);
  if (s.ok()) s = ParseLayout(args, &m, &fi);
  if (!s.ok()) return ctx.Error(s);
  const std::span<const std::string_view> suffixes = m.SessionSuffixes();
  if (ctx.server->cluster() != nullptr) {
    // Clients route the sessions by their own slots: they must be the namespace's.
    const std::string ns(args[1]);
    const int slot = cluster::KeySlot(ns);
    std::string names;
    bool split = false;
    for (std::string_view suffix : suffixes) {
      split = split || cluster::KeySlot(ns + std::string(suffix)) != slot;
      names +=
          std::string(names.empty() ? "'" : ", '") + ns.substr(0, 64) + std::string(suffix) + "'";
    }
    if (split) {
      return ctx.Error(Error("in cluster mode a namespace and its sessions " + names +
                             " must hash to one slot: give it a hash tag, e.g. '{" +
                             ns.substr(0, 64) + "}' (see PROTOCOL.md § Cluster)"));
    }
  }
  auto format = codec::ParseFormat(args[fi]);
  if (!format) {
    return ctx.Error(Error("format must be one of " + std::string(codec::FormatChoices()) +
                           ", got '" + std::string(args[fi].substr(0, 32)) + "'"));
  }
  m.format = *format;
  s = CheckLayoutFormat(m);
  if (!s.ok()) return ctx.Error(s);
  double prefill_ms = 0;
  for (size_t i = fi + 1; i < args.size(); i += 2) {
    if (i + 1 >= args.size())
      return ctx.Error(Error("option '" + std::string(args[i]) + "' needs a value"));
    std::string_view opt = args[i], val = args[i + 1];
    if (EqualsIgnoreCase(opt, "MODEL")) {
      m.model = std::string(val);
    } else if (EqualsIgnoreCase(opt, "POSITION")) {
      m.position = std::string(val);
    } else if (EqualsIgnoreCase(opt, "PREFILL_MS")) {
      char* end = nullptr;
      std::string v(val);
      prefill_ms = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || prefill_ms < 0) {
        return ctx.Error(Error("PREFILL_MS must be a non-negative number, got '" + v + "'"));
      }
    } else {
      return ctx.Error(Error("unknown option '" + std::string(opt.substr(0, 32)) +
                             "'; expected MODEL, POSITION or PREFILL_MS"));
    }
  }
  auto codec = codec::RowCodec::Create(m.format, m.dim());
  if (!codec.ok()) return ctx.Error(codec.status());
  // Sessions first: an existing "<ns>_pk" of another shape refuses the registration.
  auto& vs = ctx.shard->store().vstore;
  std::string ns(args[1]);
  auto* registry = &ctx.shard->store().prefixes;
  if (registry->Find(ctx.Key(ns)) == nullptr) {
    for (std::string_view suffix : suffixes) {
      s = vs.Create(ctx.Key(ns + std::string(suffix)), codec.value());
      if (!s.ok()) return ctx.Error(Status(ErrorKind::kMismatch, s.message()));
    }
  }
  auto entry = registry->Register(ctx.Key(ns), m, prefill_ms);
  if (!entry.ok()) return ctx.Error(entry.status());
  if (!entry.value()->resident) return ctx.rb->Ok();  // saved on disk; promoted on demand
  // A re-registration may follow a V.DROP of a session: recreate what is missing.
  for (std::string_view suffix : suffixes) {
    s = vs.Create(ctx.Key(ns + std::string(suffix)), codec.value());
    if (!s.ok()) return ctx.Error(Status(ErrorKind::kMismatch, s.message()));
  }
  ctx.rb->Ok();
}

// What a LOOKUP found, and why (EXPLAIN answers it as a map).
struct Verdict {
  server::PrefixLookup result = server::PrefixLookup::kMiss;
  std::string reason;  // "" for a hit; else a code, e.g. "incomplete"
  std::string detail;  // one sentence
  std::string expected, held;
  int64_t frontier = -1, n_tokens = -1, generation = -1;
};

struct LookupArgs {
  std::optional<std::string> model, position;
  std::optional<uint64_t> generation;
  // The reader's layout: per-head unless it says LAYOUT mla (every reader before MLA namespaces
  // existed reads per-head K/V, and must never be handed latents).
  store::PrefixLayout layout = store::PrefixLayout::kHeads;
  bool explain = false;
};

// The identity checks, before anything is opened: a verdict when they decide (the namespace
// is missing, or another model's, position's or generation's).
std::optional<Verdict> CheckIdentity(std::string_view ns, const PrefixEntry* e,
                                     const LookupArgs& a) {
  Verdict v;
  if (e == nullptr) {
    v.reason = "not_registered";
    v.detail = "no namespace '" + std::string(ns) +
               "' is registered for this tenant (a key that differs between processes, or it "
               "was dropped)";
    return v;
  }
  const PrefixManifest& m = e->manifest;
  v.n_tokens = m.n_tokens;
  v.generation = static_cast<int64_t>(m.cache_generation);
  if (a.generation && *a.generation != m.cache_generation) {
    v.result = server::PrefixLookup::kMismatch;
    v.reason = "generation_differs";
    v.expected = std::to_string(*a.generation);
    v.held = std::to_string(m.cache_generation);
    v.detail = "namespace '" + std::string(ns) + "' is at generation " + v.held + ", not " +
               v.expected + " (it was dropped and registered again)";
    return v;
  }
  if (a.layout != m.layout) {
    v.reason = "layout_differs";
    v.expected = std::string(store::LayoutName(a.layout));
    v.held = std::string(store::LayoutName(m.layout));
    v.detail = "namespace '" + std::string(ns) + "' holds " + m.DescribeLayout(ns) + ", not " +
               (a.layout == store::PrefixLayout::kMla ? "MLA latents" : "per-head K/V") +
               (m.mla() ? " (an MLA reader looks it up with LAYOUT mla)" : "");
    return v;
  }
  if (a.model && *a.model != m.model) {
    v.reason = "model_differs";
    v.expected = *a.model;
    v.held = m.model;
    v.detail =
        "namespace '" + std::string(ns) + "' holds model '" + m.model + "', not '" + *a.model + "'";
    return v;
  }
  if (a.position && *a.position != m.position) {
    v.reason = "position_differs";
    v.expected = *a.position;
    v.held = m.position;
    v.detail = "namespace '" + std::string(ns) + "' holds position digest '" + m.position +
               "', not '" + *a.position + "' (another RoPE / position contract)";
    return v;
  }
  return std::nullopt;
}

// The verdict on an open (or unopenable) namespace whose identity matched.
Verdict Judge(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
              PrefixEntry* e) {
  Verdict v;
  const PrefixManifest& m = e->manifest;
  v.n_tokens = m.n_tokens;
  v.generation = static_cast<int64_t>(m.cache_generation);
  const PrefixSessions ps = kvprefix::SessionsOf(shard, key.tenant, key.name, m);
  if (!ps.ok()) {
    v.reason = "sessions_lost";
    v.detail = "namespace '" + key.name + "' has lost its sessions (V.DROP, or another shape; " +
               m.DescribeLayout(key.name) + "): KV.PREFIX.REGISTER it again";
    return v;
  }
  Status intact = kvprefix::Intact(srv, key, e, ps);
  if (!intact.ok()) {
    v.reason = "corrupt";
    v.detail = intact.message();
    return v;
  }
  v.frontier = static_cast<int64_t>(CommittedFrontier(ps, m));
  if (!Complete(ps, m)) {
    v.reason = "incomplete";
    v.detail = "namespace '" + key.name + "' is written up to token " + std::to_string(v.frontier) +
               " of " + std::to_string(m.n_tokens) +
               " in every layer of K and V (a half-written prefix is never a hit)";
    return v;
  }
  v.result = server::PrefixLookup::kHit;
  return v;
}

void ReplyVerdict(proto::ReplyBuilder& rb, const Verdict& v, bool explain) {
  if (!explain) {
    if (v.result == server::PrefixLookup::kMismatch) {
      return rb.Error(Status(ErrorKind::kMismatch, v.detail));
    }
    return rb.SimpleString(v.result == server::PrefixLookup::kHit ? "HIT" : "MISS");
  }
  rb.Map(8);
  rb.Bulk("result");
  rb.Bulk(v.result == server::PrefixLookup::kHit    ? "HIT"
          : v.result == server::PrefixLookup::kMiss ? "MISS"
                                                    : "MISMATCH");
  rb.Bulk("reason");
  rb.Bulk(v.reason);
  rb.Bulk("detail");
  rb.Bulk(v.detail);
  rb.Bulk("expected");
  rb.Bulk(v.expected);
  rb.Bulk("held");
  rb.Bulk(v.held);
  rb.Bulk("committed_frontier");
  rb.Integer(v.frontier);
  rb.Bulk("n_tokens");
  rb.Integer(v.n_tokens);
  rb.Bulk("cache_generation");
  rb.Integer(v.generation);
}

void Lookup(CommandContext& ctx, CmdArgs& args) {
  PrefixEntry* e = ctx.shard->store().prefixes.Find(ctx.Key(args[1]));
  LookupArgs a;
  for (size_t i = 2; i < args.size(); ++i) {
    if (EqualsIgnoreCase(args[i], "EXPLAIN")) {
      a.explain = true;
      continue;
    }
    if (i + 1 >= args.size())
      return ctx.Error(Error("option '" + std::string(args[i].substr(0, 32)) + "' needs a value"));
    if (EqualsIgnoreCase(args[i], "MODEL")) {
      a.model = std::string(args[i + 1]);
    } else if (EqualsIgnoreCase(args[i], "POSITION")) {
      a.position = std::string(args[i + 1]);
    } else if (EqualsIgnoreCase(args[i], "LAYOUT")) {
      if (EqualsIgnoreCase(args[i + 1], "MLA")) {
        a.layout = store::PrefixLayout::kMla;
      } else if (EqualsIgnoreCase(args[i + 1], "HEADS")) {
        a.layout = store::PrefixLayout::kHeads;
      } else {
        return ctx.Error(Error("LAYOUT must be heads or mla, got '" +
                               std::string(args[i + 1].substr(0, 32)) + "'"));
      }
    } else if (EqualsIgnoreCase(args[i], "GENERATION")) {
      uint64_t g;
      Status s = ParseUint(args[i + 1], "GENERATION", &g);
      if (!s.ok()) return ctx.Error(s);
      a.generation = g;
    } else {
      return ctx.Error(Error("unknown option '" + std::string(args[i].substr(0, 32)) +
                             "'; expected MODEL, POSITION, LAYOUT, GENERATION or EXPLAIN"));
    }
    ++i;
  }
  const store::TenantKey key = ctx.Key(args[1]);
  server::ShardStats& stats = ctx.shard->stats();
  if (auto v = CheckIdentity(args[1], e, a)) {
    stats.CountLookup(ctx.tenant, v->result);
    return ReplyVerdict(*ctx.rb, *v, a.explain);
  }
  if (!e->resident) {
    // Saved on disk only: open it (its chunk index, read once however many clients ask), then
    // answer; the chunks come in when they are read.
    if (!e->corrupt.empty() || !e->saved_complete) {
      Verdict v;
      v.n_tokens = e->manifest.n_tokens;
      v.generation = static_cast<int64_t>(e->manifest.cache_generation);
      v.reason = !e->corrupt.empty() ? "corrupt" : "incomplete";
      v.detail = !e->corrupt.empty() ? e->corrupt
                                     : "namespace '" + key.name +
                                           "' was saved before it was complete (its disk copy "
                                           "lacks rows); a half-written prefix is never a hit";
      stats.CountLookup(ctx.tenant, v.result);
      return ReplyVerdict(*ctx.rb, v, a.explain);
    }
    auto reply = ctx.Defer();
    server::Shard* shard = ctx.shard;
    server::Server* srv = ctx.server;
    const uint32_t tenant = ctx.tenant;
    const bool explain = a.explain;
    kvprefix::Open(*ctx.server, *ctx.shard, key,
                   [reply, key, shard, srv, tenant, explain](const Status& s) {
                     PrefixEntry* cur = shard->store().prefixes.Find(key);
                     if (!s.ok() && s.kind() != ErrorKind::kCorrupt) {
                       // -OOM / -BUSY: the prefix exists but could not be brought in now.
                       return reply([s](proto::ReplyBuilder& rb) { rb.Error(s); });
                     }
                     Verdict v;
                     if (cur == nullptr) {
                       v.reason = "not_registered";
                       v.detail = "namespace '" + key.name + "' was dropped while it opened";
                     } else if (!s.ok()) {
                       v.reason = "corrupt";  // a corrupt copy is never served: a miss
                       v.detail = s.message();
                     } else {
                       v = Judge(*srv, *shard, key, cur);
                     }
                     if (v.result == server::PrefixLookup::kHit) {
                       shard->store().prefixes.Publish(cur);
                       ++cur->hits;
                     }
                     shard->stats().CountLookup(tenant, v.result);
                     reply([v, explain](proto::ReplyBuilder& rb) { ReplyVerdict(rb, v, explain); });
                   });
    return;
  }
  const Verdict v = Judge(*ctx.server, *ctx.shard, key, e);
  if (v.result == server::PrefixLookup::kHit) {
    ctx.shard->store().prefixes.Publish(e);
    ++e->hits;
  }
  stats.CountLookup(ctx.tenant, v.result);
  ReplyVerdict(*ctx.rb, v, a.explain);
}

void InfoOne(CommandContext& ctx, std::string_view ns) {
  PrefixEntry* e = ctx.shard->store().prefixes.Find(ctx.Key(ns));
  if (e == nullptr) return ctx.Error(Error("no such prefix namespace '" + std::string(ns) + "'"));
  const PrefixManifest& m = e->manifest;
  PrefixSessions s = SessionsOf(ctx, ns, m);
  uint64_t frontier =
      e->resident ? (s.ok() ? CommittedFrontier(s, m) : 0) : (e->saved_complete ? m.n_tokens : 0);
  uint64_t bytes = 0;
  for (const store::VSession* sess : s.all()) bytes += sess->host_bytes();
  auto& rb = *ctx.rb;
  rb.Map(24);
  rb.Bulk("model");
  rb.Bulk(m.model);
  rb.Bulk("position");
  rb.Bulk(m.position);
  rb.Bulk("n_layers");
  rb.Integer(m.n_layers);
  rb.Bulk("n_tokens");
  rb.Integer(m.n_tokens);
  rb.Bulk("kv_heads");
  rb.Integer(m.kv_heads);
  rb.Bulk("head_dim");
  rb.Integer(m.head_dim);
  rb.Bulk("format");
  rb.Bulk(codec::FormatName(m.format));
  rb.Bulk("layout");
  rb.Bulk(store::LayoutName(m.layout));
  rb.Bulk("kv_lora_rank");
  rb.Integer(m.kv_lora_rank);
  rb.Bulk("rope_dim");
  rb.Integer(m.rope_dim);
  rb.Bulk("cache_generation");
  rb.Integer(static_cast<int64_t>(m.cache_generation));
  rb.Bulk("publication_generation");
  rb.Integer(static_cast<int64_t>(e->publication));
  rb.Bulk("committed_frontier");
  rb.Integer(static_cast<int64_t>(frontier));
  rb.Bulk("complete");
  rb.Integer(frontier == m.n_tokens ? 1 : 0);
  rb.Bulk("prefill_ms");
  rb.Double(e->prefill_ms, 3);
  rb.Bulk("fetches");
  rb.Integer(static_cast<int64_t>(e->hits));
  rb.Bulk("saved_prefill_ms");
  rb.Double(e->prefill_ms * static_cast<double>(e->hits), 3);
  rb.Bulk("bytes_ram");
  rb.Integer(static_cast<int64_t>(bytes));
  rb.Bulk("bytes_disk");
  rb.Integer(static_cast<int64_t>(e->disk_bytes));
  rb.Bulk("saved_version");
  rb.Integer(static_cast<int64_t>(e->saved_version));
  rb.Bulk("resident");
  rb.Integer(e->resident ? 1 : 0);
  rb.Bulk("corrupt");
  rb.Bulk(e->corrupt);
  rb.Bulk("opening");
  rb.Integer(e->opening ? 1 : 0);
  rb.Bulk("owner");
  rb.Integer(ctx.shard->id());
}

void Info(CommandContext& ctx, CmdArgs& args) {
  if (args.size() == 2) return InfoOne(ctx, args[1]);  // routed to the namespace's shard
  if (args.size() > 2) return ctx.Error(Error("syntax: KV.PREFIX.INFO [<ns>]"));
  const uint32_t tenant = ctx.tenant;
  ReplySumOverShards(
      ctx,
      {{"prefixes"},
       {"tokens"},
       {"fetches"},
       {"saved_prefill_ms", true},
       {"bytes_ram"},
       {"bytes_disk"}},
      [tenant](server::Shard& shard) {
        std::vector<double> t(6, 0.0);
        auto& vs = shard.store().vstore;
        shard.store().prefixes.ForEach(
            tenant, [&](const store::TenantKey& k, const PrefixEntry& e) {
              t[0] += 1;
              t[1] += e.manifest.n_tokens;
              t[2] += static_cast<double>(e.hits);
              t[3] += e.prefill_ms * static_cast<double>(e.hits);
              for (std::string_view suffix : e.manifest.SessionSuffixes()) {
                if (auto* s = vs.Find(store::TenantKey{tenant, k.name + std::string(suffix)})) {
                  t[4] += static_cast<double>(s->session->host_bytes());
                }
              }
              t[5] += static_cast<double>(e.disk_bytes);
            });
        return t;
      });
}

// Per 64-token block: rows written (K and V, all layers) and where the block is resident.
void Blocks(CommandContext& ctx, CmdArgs& args, bool membership_only) {
  PrefixEntry* e = ctx.shard->store().prefixes.Find(ctx.Key(args[1]));
  if (e == nullptr)
    return ctx.Error(Error("no such prefix namespace '" + std::string(args[1]) + "'"));
  const PrefixManifest& m = e->manifest;
  PrefixSessions s = SessionsOf(ctx, args[1], m);
  const uint64_t n_blocks = (m.n_tokens + kBlockTokens - 1) / kBlockTokens;
  std::vector<uint64_t> rows(n_blocks, 0), want(n_blocks, 0);
  std::vector<bool> in_memory(n_blocks, true);
  for (uint64_t b = 0; b < n_blocks; ++b) {
    uint64_t t0 = b * kBlockTokens, t1 = std::min<uint64_t>(t0 + kBlockTokens, m.n_tokens);
    want[b] = m.SessionSuffixes().size() * m.n_layers * (t1 - t0);
    if (!s.ok()) continue;
    for (uint64_t l = 0; l < m.n_layers; ++l) {
      int64_t a = static_cast<int64_t>(l * m.n_tokens + t0),
              z = static_cast<int64_t>(l * m.n_tokens + t1);
      for (const store::VSession* sess : s.all()) rows[b] += sess->CountWritten(a, z);
      if (!membership_only && in_memory[b]) {
        for (const store::VSession* sess : s.all()) {
          std::vector<residency::ObjectRef> missing;
          sess->MissingForRange(a, static_cast<size_t>(z - a), &missing);
          if (!missing.empty()) in_memory[b] = false;
        }
      }
    }
  }
  auto& rb = *ctx.rb;
  if (membership_only) {
    std::vector<uint64_t> resident;
    for (uint64_t b = 0; b < n_blocks; ++b) {
      if (rows[b] > 0) resident.push_back(b);
    }
    rb.Array(resident.size());
    for (uint64_t b : resident) rb.Integer(static_cast<int64_t>(b));
    return;
  }
  rb.Array(n_blocks);
  for (uint64_t b = 0; b < n_blocks; ++b) {
    rb.Map(5);
    rb.Bulk("block");
    rb.Integer(static_cast<int64_t>(b));
    rb.Bulk("written");
    rb.Integer(rows[b] == want[b] ? 1 : 0);
    rb.Bulk("rows");
    rb.Integer(static_cast<int64_t>(rows[b]));
    rb.Bulk("tier");
    // Where its rows are now: all in memory, some or all only on disk (brought back on read).
    rb.Bulk(!e->resident   ? (e->saved_version > 0 ? "disk" : "none")
            : rows[b] == 0 ? "none"
            : in_memory[b] ? "ram"
                           : "disk");
    // Saved means the disk copy holds this block's current rows; after a write the whole
    // namespace counts as unsaved until the next SAVE (conservative: never claims too much).
    rb.Bulk("saved");
    rb.Integer(e->saved_version > 0 && !e->dirty ? 1 : 0);
  }
}

void BlocksCmd(CommandContext& ctx, CmdArgs& args) { Blocks(ctx, args, false); }
void Membership(CommandContext& ctx, CmdArgs& args) { Blocks(ctx, args, true); }

void Owner(CommandContext& ctx, CmdArgs& args) { ctx.rb->Integer(ctx.shard->id()); }

void Drop(CommandContext& ctx, CmdArgs& args) {
  std::string ns(args[1]);
  uint64_t saved_version = 0;
  std::span<const std::string_view> suffixes;
  if (PrefixEntry* e = ctx.shard->store().prefixes.Find(ctx.Key(ns))) {
    saved_version = e->saved_version;
    suffixes = e->manifest.SessionSuffixes();
    if (e->opening) kvprefix::CancelOpen(e, Error("namespace '" + ns + "' was dropped"));
    if (e->saved_version > 0 || !e->corrupt.empty()) {
      // Delete everywhere, disk included (a few file unlinks and one directory fsync).
      Status s = store::disk::RemoveObject(
          kvprefix::PrefixDir(*ctx.server),
          store::PrefixObjectName(ctx.server->users().TenantName(ctx.tenant), ns));
      if (!s.ok()) return ctx.Error(s);
    }
  }
  bool existed = ctx.shard->store().prefixes.Drop(ctx.Key(ns));
  if (existed) {
    auto& vs = ctx.shard->store().vstore;
    for (std::string_view suffix : suffixes) vs.Drop(ctx.Key(ns + std::string(suffix)));
    if (saved_version > 0 && cluster_sync::Enabled(*ctx.server)) {
      // Cluster mode: acknowledged once the replicas dropped their copies too.
      auto reply = ctx.Defer();
      cluster_sync::ReplicateDrop(
          *ctx.server, {"PREFIX", ctx.server->users().TenantName(ctx.tenant), ns, ""},
          saved_version,
          cluster_sync::AnswerWith(reply, [](proto::ReplyBuilder& rb) { rb.Integer(1); }));
      return;
    }
  }
  ctx.rb->Integer(existed ? 1 : 0);
}

}  // namespace

void RegisterKvPrefixFamily(server::Server& srv) {
  kvprefix::RegisterTierCommands(srv);
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  r.Register({"KV.PREFIX.REGISTER", -7, kKv | kCmdWrite, 1, 1, 1, Register, "kvprefix",
              "Registers a shared prefix namespace and its V-store sessions: <ns>_pk/<ns>_pv "
              "(per-head K/V), or <ns>_pl (MLA latents).",
              "<ns> <n_layers> <n_tokens> <kv_heads> <head_dim> | MLA <kv_lora_rank> <rope_dim>, "
              "then <format> [MODEL <id>] [POSITION <digest>] [PREFILL_MS <ms>]"});
  r.Register({"KV.PREFIX.LOOKUP", -2, kKv | kCmdReadOnly, 1, 1, 1, Lookup, "kvprefix",
              "HIT when the prefix is complete and its identity matches; MISS otherwise; "
              "EXPLAIN: why, as a map.",
              "<ns> [MODEL <id>] [POSITION <digest>] [LAYOUT heads|mla] [GENERATION <g>] "
              "[EXPLAIN]"});
  r.Register({"KV.PREFIX.INFO", -1, kKv | kCmdReadOnly | kCmdConnection, 1, 1, 1, Info, "kvprefix",
              "A namespace's manifest and state, or the caller's totals without a namespace.",
              "[<ns>]"});
  r.Register({"KV.PREFIX.BLOCKS", 2, kKv | kCmdReadOnly, 1, 1, 1, BlocksCmd, "kvprefix",
              "Per 64-token block: written, rows, resident tier, saved.", "<ns>"});
  r.Register({"KV.PREFIX.MEMBERSHIP", 2, kKv | kCmdReadOnly, 1, 1, 1, Membership, "kvprefix",
              "Indexes of the blocks resident in memory.", "<ns>"});
  r.Register({"KV.PREFIX.OWNER", 2, kKv | kCmdReadOnly, 1, 1, 1, Owner, "kvprefix",
              "The shard that owns the namespace.", "<ns>"});
  r.Register({"KV.PREFIX.DROP", 2, kKv | kCmdWrite, 1, 1, 1, Drop, "kvprefix",
              "Deletes a namespace and its sessions; the next REGISTER gets a new generation.",
              "<ns>"});
}

}  // namespace pion::families
