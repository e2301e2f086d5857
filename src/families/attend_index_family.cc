// ATTEND.* — the HNSW attention index (seed 000; seed 004 §0x07G–0x07G1, §0x07C): CREATE a
// session, STORE token K/V rows (staged, with positions), FINALIZE (build the graph on the compute
// pool, then publish it), QUERY (top-k keys for queries, optionally attention over the rows found
// with its LSE), INFO, DROP. The data structure is store/attn_index.
#include <chrono>
#include <cstring>
#include <optional>

#include "families/args.h"
#include "families/attend_prefix_internal.h"
#include "families/families.h"
#include "server/server.h"
#include "store/attn_index.h"

namespace pion::families {
namespace {

using attend::ParseCount;
using proto::CmdArgs;
using server::CommandContext;

constexpr uint32_t kMaxDim = 4096;
constexpr uint32_t kMaxK = 65536;

Status NoSession(std::string_view sid) {
  return Status(ErrorKind::kMiss,
                "no attention session '" + std::string(sid.substr(0, 128)) + "'; ATTEND.CREATE it");
}

// ATTEND.CREATE <sid> <key_dim> <value_dim> [M <m>] [EF_CONSTRUCTION <n>] [METRIC ip|l2|cos]
void Create(CommandContext& ctx, CmdArgs& args) {
  store::IndexParams p;
  Status s = ParseCount(args[2], "key_dim", kMaxDim, &p.key_dim);
  if (s.ok()) s = ParseCount(args[3], "value_dim", kMaxDim, &p.value_dim);
  for (size_t i = 4; s.ok() && i < args.size(); i += 2) {
    if (i + 1 >= args.size()) {
      s = Error("option '" + std::string(args[i].substr(0, 32)) + "' needs a value");
    } else if (EqualsIgnoreCase(args[i], "M")) {
      s = ParseCount(args[i + 1], "M", 128, &p.m);
      if (s.ok() && p.m < 2) s = Error("M must be an integer in [2, 128], got '1'");
    } else if (EqualsIgnoreCase(args[i], "EF_CONSTRUCTION")) {
      s = ParseCount(args[i + 1], "EF_CONSTRUCTION", kMaxK, &p.ef_construction);
    } else if (EqualsIgnoreCase(args[i], "METRIC")) {
      if (EqualsIgnoreCase(args[i + 1], "ip")) {
        p.metric = store::IndexMetric::kIp;
      } else if (EqualsIgnoreCase(args[i + 1], "l2")) {
        p.metric = store::IndexMetric::kL2;
      } else if (EqualsIgnoreCase(args[i + 1], "cos")) {
        p.metric = store::IndexMetric::kCos;
      } else {
        s = Error("METRIC must be ip, l2 or cos, got '" + std::string(args[i + 1].substr(0, 32)) +
                  "'");
      }
    } else {
      s = Error("unknown option '" + std::string(args[i].substr(0, 32)) +
                "'; expected M, EF_CONSTRUCTION or METRIC");
    }
  }
  if (!s.ok()) return ctx.Error(s);
  auto created = ctx.shard->store().index.Create(ctx.Key(args[1]), p);
  if (!created.ok()) return ctx.Error(created.status());
  ctx.rb->Ok();
}

// ATTEND.STORE <sid> <keys_blob> <values_blob> [<start_pos>] → rows staged in the session.
void Store(CommandContext& ctx, CmdArgs& args) {
  if (args.size() > 5) {
    return ctx.Error(
        Error("wrong number of arguments for 'attend.store': expected <sid> "
              "<keys_blob> <values_blob> [<start_pos>]"));
  }
  auto& idx = ctx.shard->store().index;
  store::IndexSession* sess = idx.Find(ctx.Key(args[1]));
  if (sess == nullptr) return ctx.Error(NoSession(args[1]));
  const uint64_t krow = uint64_t{sess->params.key_dim} * 4,
                 vrow = uint64_t{sess->params.value_dim} * 4;
  const uint64_t kb = args[2].size(), vb = args[3].size();
  if (kb == 0 || kb % krow != 0) {
    return ctx.Error(Error("keys_blob must be a non-zero multiple of key_dim*4 = " +
                           std::to_string(krow) + " bytes, got " + std::to_string(kb)));
  }
  const uint64_t n = kb / krow;
  if (vb != n * vrow) {
    return ctx.Error(Error("values_blob must be N*value_dim*4 (N=" + std::to_string(n) +
                           " value_dim=" + std::to_string(sess->params.value_dim) + ") = " +
                           std::to_string(n * vrow) + " bytes, got " + std::to_string(vb)));
  }
  int64_t start = static_cast<int64_t>(sess->rows.size());
  if (args.size() == 5) {
    Status s = ParseInt(args[4], "start_pos", &start);
    if (s.ok() && (start < 0 || start > (int64_t{1} << 62))) {
      s = Error("start_pos must be in [0, 2^62], got " + std::to_string(start));
    }
    if (!s.ok()) return ctx.Error(s);
  }
  if (sess->rows.size() + n > (uint64_t{1} << 32) - 1) {
    return ctx.Error(Error("a session holds at most 2^32 - 1 rows"));
  }
  // Blobs are unaligned views of the request: Append copies them (one memcpy per chunk).
  std::vector<float> keys(n * sess->params.key_dim), values(n * sess->params.value_dim);
  std::memcpy(keys.data(), args[2].data(), kb);
  std::memcpy(values.data(), args[3].data(), vb);
  Status s = idx.Append(*sess, keys.data(), values.data(), n, start);
  if (!s.ok()) return ctx.Error(s);
  ctx.rb->Integer(static_cast<int64_t>(sess->rows.size()));
}

// ATTEND.FINALIZE <sid>: builds the graph over every row staged so far on the compute pool and
// publishes it on the session's shard; the reply follows the publication.
void Finalize(CommandContext& ctx, CmdArgs& args) {
  server::Server* srv = ctx.server;
  store::IndexSession* sess = ctx.shard->store().index.Find(ctx.Key(args[1]));
  if (sess == nullptr) return ctx.Error(NoSession(args[1]));
  if (sess->building) {
    return ctx.Error(Status(ErrorKind::kBusy, "a FINALIZE of this session is already running"));
  }
  if (sess->rows.size() == 0) {
    return ctx.Error(Error("session '" + std::string(args[1].substr(0, 128)) +
                           "' has no rows; ATTEND.STORE some first"));
  }
  sess->building = true;
  const uint64_t generation = sess->next_generation++;
  const store::IndexParams params = sess->params;
  store::IndexRows snapshot = sess->rows;  // shares the chunks: O(chunks)
  const store::TenantKey sid = ctx.Key(args[1]);
  const int shard_id = ctx.shard->id();
  auto reply = ctx.Defer();
  bool queued = srv->compute()->Submit([srv, shard_id, sid, params, snapshot, generation, reply]() {
    server::WorkerPool* pool = srv->compute();
    auto built = store::BuiltIndex::Build(
        params, snapshot, generation,
        [pool](size_t n, const std::function<void(size_t)>& fn) { pool->ParallelFor(n, fn); });
    srv->shard(shard_id).PostControl([sid, built, reply](server::Shard& sh) {
      store::IndexSession* s = sh.store().index.Find(sid);
      if (s == nullptr) {
        return reply([](proto::ReplyBuilder& rb) {
          rb.Error(Error("the session was dropped while its index was being built"));
        });
      }
      s->building = false;
      Status st = built.ok() ? sh.store().index.Publish(*s, built.value()) : built.status();
      if (!st.ok()) return reply([st](proto::ReplyBuilder& rb) { rb.Error(st); });
      const auto& idx = *built.value();
      reply([gen = idx.generation(), rows = idx.rows().size(), recall = idx.recall_estimate(),
             ms = idx.build_ms(), cal_ms = idx.calibrate_ms()](proto::ReplyBuilder& rb) {
        rb.Map(5);
        rb.Bulk("generation");
        rb.Integer(static_cast<int64_t>(gen));
        rb.Bulk("rows");
        rb.Integer(static_cast<int64_t>(rows));
        rb.Bulk("recall_estimate");
        rb.Double(recall, 6);
        rb.Bulk("build_ms");
        rb.Double(ms, 3);
        rb.Bulk("calibrate_ms");
        rb.Double(cal_ms, 3);
      });
    });
  });
  if (!queued) {
    sess->building = false;
    ctx.shard->stats().Reject(server::RejectReason::kBusy);
    reply([](proto::ReplyBuilder& rb) {
      rb.Error(Status(ErrorKind::kBusy, "the compute queue is full; retry later"));
    });
  }
}

// ATTEND.QUERY <sid> <k> <q_blob> [EF <ef> | EXACT] [ATTEND]
void Query(CommandContext& ctx, CmdArgs& args) {
  uint32_t k = 0, ef = 0;
  bool attend = false, exact = false;
  Status s = ParseCount(args[2], "k", kMaxK, &k);
  for (size_t i = 4; s.ok() && i < args.size(); ++i) {
    if (EqualsIgnoreCase(args[i], "ATTEND")) {
      attend = true;
    } else if (EqualsIgnoreCase(args[i], "EXACT")) {
      exact = true;
    } else if (EqualsIgnoreCase(args[i], "EF") && i + 1 < args.size()) {
      s = ParseCount(args[++i], "EF", kMaxK, &ef);
    } else {
      s = Error("unexpected argument '" + std::string(args[i].substr(0, 32)) +
                "'; expected EF <ef>, EXACT or ATTEND");
    }
  }
  if (s.ok() && exact && ef != 0) s = Error("EXACT scans every key; it takes no EF");
  if (!s.ok()) return ctx.Error(s);
  store::IndexSession* sess = ctx.shard->store().index.Find(ctx.Key(args[1]));
  if (sess == nullptr) return ctx.Error(NoSession(args[1]));
  if (!sess->index) {
    return ctx.Error(Error("session '" + std::string(args[1].substr(0, 128)) +
                           "' has no index yet (" + std::to_string(sess->rows.size()) +
                           " rows staged); ATTEND.FINALIZE it"));
  }
  const uint64_t qrow = uint64_t{sess->params.key_dim} * 4;
  if (args[3].empty() || args[3].size() % qrow != 0) {
    return ctx.Error(Error("q_blob must be a non-zero multiple of key_dim*4 = " +
                           std::to_string(qrow) + " bytes, got " + std::to_string(args[3].size())));
  }
  const uint64_t m = args[3].size() / qrow;
  auto q = std::make_shared<std::vector<float>>(m * sess->params.key_dim);
  std::memcpy(q->data(), args[3].data(), args[3].size());
  std::shared_ptr<const store::BuiltIndex> index = sess->index;
  auto queries = sess->queries;
  auto query_ns = sess->query_ns;
  server::Server* srv = ctx.server;
  auto reply = ctx.Defer();
  bool queued = srv->compute()->Submit([index, q, m, k, ef, attend, exact, queries, query_ns,
                                        reply]() {
    const auto t0 = std::chrono::steady_clock::now();
    const store::IndexRows& rows = index->rows();
    const uint32_t kk = static_cast<uint32_t>(std::min<uint64_t>(k, rows.size()));
    const uint32_t dk = index->params().key_dim, dv = index->params().value_dim;
    auto ids = std::make_shared<std::string>(m * kk * 4, '\0');
    auto pos = std::make_shared<std::string>(m * kk * 8, '\0');
    auto scores = std::make_shared<std::string>(m * kk * 4, '\0');
    auto out = std::make_shared<std::string>(attend ? m * dv * 4 : 0, '\0');
    auto lse = std::make_shared<std::string>(attend ? m * 4 : 0, '\0');
    // The receipt: EXACT, or no EF where the calibration chose the scan, is exact; a search
    // reports the calibrated recall@32 of its beam.
    const store::BuiltIndex::Plan& plan = index->plan();
    const bool scan = exact || (ef == 0 && plan.scan);
    const uint32_t beam = scan ? 0 : std::max(ef ? ef : plan.ef, kk);
    const double recall = scan ? 1.0 : ef ? index->RecallAt(beam) : plan.recall;
    for (uint64_t i = 0; i < m; ++i) {
      auto hits = scan ? index->BruteForce(q->data() + i * dk, kk)
                       : index->Search(q->data() + i * dk, kk, beam);
      std::vector<uint32_t> found;
      for (uint32_t j = 0; j < hits.size(); ++j) {
        const int64_t p = rows.Position(hits[j].id);
        std::memcpy(ids->data() + (i * kk + j) * 4, &hits[j].id, 4);
        std::memcpy(pos->data() + (i * kk + j) * 8, &p, 8);
        std::memcpy(scores->data() + (i * kk + j) * 4, &hits[j].score, 4);
        found.push_back(hits[j].id);
      }
      if (attend) {
        store::AttendRows(rows, q->data() + i * dk, found,
                          reinterpret_cast<float*>(out->data() + i * dv * 4),
                          reinterpret_cast<float*>(lse->data() + i * 4));
      }
    }
    queries->fetch_add(m, std::memory_order_relaxed);
    query_ns->fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                  std::chrono::steady_clock::now() - t0)
                                                  .count()),
                        std::memory_order_relaxed);
    reply([=, gen = index->generation()](proto::ReplyBuilder& rb) {
      rb.Map(attend ? 10 : 8);
      rb.Bulk("generation");
      rb.Integer(static_cast<int64_t>(gen));
      rb.Bulk("k");
      rb.Integer(kk);
      rb.Bulk("exact");
      rb.Integer(scan ? 1 : 0);
      rb.Bulk("ef");
      rb.Integer(beam);
      rb.Bulk("recall_estimate");
      rb.Double(recall, 6);
      rb.Bulk("ids");
      rb.Bulk(*ids);
      rb.Bulk("positions");
      rb.Bulk(*pos);
      rb.Bulk("scores");
      rb.Bulk(*scores);
      if (attend) {
        rb.Bulk("output");
        rb.Bulk(*out);
        rb.Bulk("lse");
        rb.Bulk(*lse);
      }
    });
  });
  if (!queued) {
    ctx.shard->stats().Reject(server::RejectReason::kBusy);
    reply([](proto::ReplyBuilder& rb) {
      rb.Error(Status(ErrorKind::kBusy, "the compute queue is full; retry later"));
    });
  }
}

// ATTEND.INFO [<sid>]
void Info(CommandContext& ctx, CmdArgs& args) {
  auto& rb = *ctx.rb;
  if (args.size() == 1) {
    store::IndexStore::Usage u;
    for (int i = 0; i < ctx.server->shard_count(); ++i) {
      auto t = ctx.server->shard(i).store().index.Total();
      u.sessions += t.sessions;
      u.rows += t.rows;
      u.indexed_rows += t.indexed_rows;
      u.bytes += t.bytes;
    }
    rb.Map(4);
    rb.Bulk("sessions");
    rb.Integer(static_cast<int64_t>(u.sessions));
    rb.Bulk("rows");
    rb.Integer(static_cast<int64_t>(u.rows));
    rb.Bulk("indexed_rows");
    rb.Integer(static_cast<int64_t>(u.indexed_rows));
    rb.Bulk("bytes");
    rb.Integer(static_cast<int64_t>(u.bytes));
    return;
  }
  store::IndexSession* s = ctx.shard->store().index.Find(ctx.Key(args[1]));
  if (s == nullptr) return ctx.Error(NoSession(args[1]));
  rb.Map(17);
  rb.Bulk("key_dim");
  rb.Integer(s->params.key_dim);
  rb.Bulk("value_dim");
  rb.Integer(s->params.value_dim);
  rb.Bulk("metric");  // text, not bytes: typed replies (binary frames) decode it as a string
  rb.SimpleString(store::IndexMetricName(s->params.metric));
  rb.Bulk("m");
  rb.Integer(s->params.m);
  rb.Bulk("ef_construction");
  rb.Integer(s->params.ef_construction);
  rb.Bulk("rows");
  rb.Integer(static_cast<int64_t>(s->rows.size()));
  rb.Bulk("indexed_rows");
  rb.Integer(static_cast<int64_t>(s->index ? s->index->rows().size() : 0));
  rb.Bulk("generation");
  rb.Integer(static_cast<int64_t>(s->index ? s->index->generation() : 0));
  rb.Bulk("building");
  rb.Bool(s->building);
  rb.Bulk("queries");
  const uint64_t nq = s->queries->load(std::memory_order_relaxed);
  rb.Integer(static_cast<int64_t>(nq));
  rb.Bulk("query_us");  // mean worker time per query
  rb.Double(nq ? s->query_ns->load(std::memory_order_relaxed) / 1e3 / static_cast<double>(nq) : 0.0,
            3);
  rb.Bulk("bytes");
  rb.Integer(static_cast<int64_t>(s->charged_rows + s->charged_index));
  rb.Bulk("recall_estimate");
  rb.Double(s->index ? s->index->recall_estimate() : 0.0, 6);
  rb.Bulk("build_ms");
  rb.Double(s->index ? s->index->build_ms() : 0.0, 3);
  rb.Bulk("calibrate_ms");
  rb.Double(s->index ? s->index->calibrate_ms() : 0.0, 3);
  rb.Bulk("default_exact");  // a query without EF scans (the calibration found it cheaper)
  rb.Integer(s->index && s->index->plan().scan ? 1 : 0);
  rb.Bulk("default_ef");  // else its beam
  rb.Integer(s->index && !s->index->plan().scan ? s->index->plan().ef : 0);
}

void Drop(CommandContext& ctx, CmdArgs& args) {
  ctx.rb->Integer(ctx.shard->store().index.Drop(ctx.Key(args[1])) ? 1 : 0);
}

}  // namespace

void RegisterAttendIndexFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  r.Register({"ATTEND.CREATE", -4, kKv | kCmdWrite, 1, 1, 1, Create, "attend_index",
              "Creates an attention index session.",
              "<sid> <key_dim> <value_dim> [M <m>] [EF_CONSTRUCTION <n>] [METRIC ip|l2|cos]"});
  r.Register({"ATTEND.STORE", -4, kKv | kCmdWrite | kCmdDenyOom, 1, 1, 1, Store, "attend_index",
              "Stages token K/V rows (fp32) with their positions; replies the rows staged.",
              "<sid> <keys_blob> <values_blob> [<start_pos>]"});
  r.Register({"ATTEND.FINALIZE", 2, kKv | kCmdWrite, 1, 1, 1, Finalize, "attend_index",
              "Builds the HNSW index over the staged keys and publishes it.", "<sid>"});
  r.Register({"ATTEND.QUERY", -4, kKv | kCmdReadOnly, 1, 1, 1, Query, "attend_index",
              "Top-k rows for each query (ids, positions, scores) with a receipt (exact, beam, "
              "recall estimate); EXACT scans every key; with ATTEND also attention over them "
              "and its LSE.",
              "<sid> <k> <q_blob> [EF <ef> | EXACT] [ATTEND]"});
  r.Register({"ATTEND.INFO", -1, kKv | kCmdReadOnly, 1, 1, 1, Info, "attend_index",
              "One session's parameters, rows, index generation, queries and recall estimate; "
              "without a session, the totals.",
              "[<sid>]"});
  r.Register({"ATTEND.DROP", 2, kKv | kCmdWrite, 1, 1, 1, Drop, "attend_index",
              "Drops a session (rows and index); replies 1, or 0 when there was none.", "<sid>"});
  srv.AddShardInit([&srv](Shard& shard) {
    shard.store().index.set_budget(srv.memory().BudgetFor(MemFamily::kIndex));
  });
}

}  // namespace pion::families
