// KV.STORE / KV.FETCH / KV.INFO / KV.EVICT — tensors cached under an embedding and fetched by
// the nearest one (cosine), with a MODEL identity fence, TTL, per-tenant capacity and LRU
// eviction. The data structure is store/semantic_cache (one per server, thread-safe: the
// commands are keyless and run on the connection's shard).
#include <cmath>
#include <cstring>
#include <optional>

#include "families/args.h"
#include "families/families.h"
#include "server/server.h"

namespace pion::families {
namespace {

using proto::CmdArgs;
using server::CommandContext;

constexpr int64_t kMaxTtlSeconds = int64_t{10} * 365 * 86400;
constexpr uint32_t kMaxEmbeddingDim = 1 << 16;
constexpr float kDefaultThreshold = 0.95f;

Status ParseEmbedding(std::string_view blob, std::string_view what, std::vector<float>* out) {
  if (blob.empty() || blob.size() % 4 != 0 || blob.size() / 4 > kMaxEmbeddingDim) {
    return Error(std::string(what) +
                 " must be 1 to 65536 fp32 values (a non-zero multiple of 4 "
                 "bytes), got " +
                 std::to_string(blob.size()) + " bytes");
  }
  out->resize(blob.size() / 4);
  std::memcpy(out->data(), blob.data(), blob.size());
  return Status::Ok();
}

// KV.STORE <key_embedding_blob> <tensor_blob> [MODEL <id>] [TTL <seconds>] → :id
void Store(CommandContext& ctx, CmdArgs& args) {
  std::vector<float> key;
  Status s = ParseEmbedding(args[1], "key_embedding", &key);
  std::string model;
  int64_t ttl = 0;
  for (size_t i = 3; s.ok() && i < args.size(); i += 2) {
    if (i + 1 >= args.size()) {
      s = Error("option '" + std::string(args[i].substr(0, 32)) + "' needs a value");
    } else if (EqualsIgnoreCase(args[i], "MODEL")) {
      model = std::string(args[i + 1]);
      if (model.empty()) s = Error("MODEL must not be empty");
    } else if (EqualsIgnoreCase(args[i], "TTL")) {
      s = ParseInt(args[i + 1], "TTL", &ttl);
      if (s.ok() && (ttl < 1 || ttl > kMaxTtlSeconds)) {
        s = Error("TTL must be an integer number of seconds in [1, " +
                  std::to_string(kMaxTtlSeconds) + "], got " + std::to_string(ttl));
      }
    } else {
      s = Error("unknown option '" + std::string(args[i].substr(0, 32)) +
                "'; expected MODEL or TTL");
    }
  }
  if (!s.ok()) return ctx.Error(s);
  auto tensor = args.TakeBuffer(2);  // adopts the received bytes
  if (!tensor.ok()) return ctx.Error(tensor.status());
  auto id = ctx.server->kv_cache()->Store(ctx.tenant, key.data(), static_cast<uint32_t>(key.size()),
                                          std::move(tensor).value(), std::move(model),
                                          std::chrono::seconds(ttl));
  if (!id.ok()) return ctx.Error(id.status());
  ctx.rb->Integer(static_cast<int64_t>(id.value()));
}

// KV.FETCH <query_embedding_blob> [MODEL <id>] [THRESHOLD <cos>] → map or nil
void Fetch(CommandContext& ctx, CmdArgs& args) {
  std::vector<float> q;
  Status s = ParseEmbedding(args[1], "query_embedding", &q);
  std::optional<std::string> model;
  float threshold = kDefaultThreshold;
  for (size_t i = 2; s.ok() && i < args.size(); i += 2) {
    if (i + 1 >= args.size()) {
      s = Error("option '" + std::string(args[i].substr(0, 32)) + "' needs a value");
    } else if (EqualsIgnoreCase(args[i], "MODEL")) {
      model = std::string(args[i + 1]);
    } else if (EqualsIgnoreCase(args[i], "THRESHOLD")) {
      double t = 0;
      const std::string text(args[i + 1].substr(0, 64));
      char* end = nullptr;
      t = std::strtod(text.c_str(), &end);
      if (text.empty() || end != text.c_str() + text.size() || !(t >= -1.0 && t <= 1.0)) {
        s = Error("THRESHOLD must be a cosine in [-1, 1], got '" + text + "'");
      }
      threshold = static_cast<float>(t);
    } else {
      s = Error("unknown option '" + std::string(args[i].substr(0, 32)) +
                "'; expected MODEL or THRESHOLD");
    }
  }
  if (!s.ok()) return ctx.Error(s);
  auto hit = ctx.server->kv_cache()->Fetch(ctx.tenant, q.data(), static_cast<uint32_t>(q.size()),
                                           model, threshold);
  auto& rb = *ctx.rb;
  if (!hit) return rb.Null();
  rb.Map(4);
  rb.Bulk("id");
  rb.Integer(static_cast<int64_t>(hit->id));
  rb.Bulk("similarity");
  rb.Double(hit->similarity, 6);
  rb.Bulk("model");
  rb.Bulk(hit->model);
  rb.Bulk("tensor");
  rb.BulkRef(hit->tensor);
}

void Info(CommandContext& ctx, CmdArgs& args) {
  const auto st = ctx.server->kv_cache()->StatsOf(ctx.tenant);
  auto& rb = *ctx.rb;
  rb.Map(7);
  rb.Bulk("entries");
  rb.Integer(static_cast<int64_t>(st.entries));
  rb.Bulk("blob_bytes");
  rb.Integer(static_cast<int64_t>(st.blob_bytes));
  rb.Bulk("hits");
  rb.Integer(static_cast<int64_t>(st.hits));
  rb.Bulk("misses");
  rb.Integer(static_cast<int64_t>(st.misses));
  rb.Bulk("capacity");
  rb.Integer(static_cast<int64_t>(st.capacity));
  rb.Bulk("evictions");
  rb.Integer(static_cast<int64_t>(st.evictions));
  rb.Bulk("expired");
  rb.Integer(static_cast<int64_t>(st.expired));
}

// KV.EVICT <id>|ALL|EXPIRED → :count
void Evict(CommandContext& ctx, CmdArgs& args) {
  store::SemanticCache& c = *ctx.server->kv_cache();
  size_t n;
  if (EqualsIgnoreCase(args[1], "ALL")) {
    n = c.EvictAll(ctx.tenant);
  } else if (EqualsIgnoreCase(args[1], "EXPIRED")) {
    n = c.EvictExpired(ctx.tenant);
  } else {
    int64_t id = 0;
    if (!ParseInt64(args[1], &id) || id < 1) {
      return ctx.Error(
          Error("KV.EVICT takes an entry id (a positive integer), ALL or EXPIRED, "
                "got '" +
                std::string(args[1].substr(0, 32)) + "'"));
    }
    n = c.EvictId(ctx.tenant, static_cast<uint64_t>(id));
  }
  ctx.rb->Integer(static_cast<int64_t>(n));
}

}  // namespace

void RegisterKvCacheFamily(server::Server& srv) {
  using namespace server;
  srv.set_kv_cache(std::make_unique<store::SemanticCache>(
      srv.config().kv_cache_capacity, srv.memory().BudgetFor(MemFamily::kIndex)));
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  r.Register({"KV.STORE", -3, kKv | kCmdWrite | kCmdDenyOom, 0, 0, 0, Store, "kv_cache",
              "Caches a tensor under an embedding (MODEL fence, TTL); replies its id.",
              "<key_embedding_blob> <tensor_blob> [MODEL <id>] [TTL <seconds>]"});
  r.Register({"KV.FETCH", -2, kKv | kCmdReadOnly, 0, 0, 0, Fetch, "kv_cache",
              "The entry nearest to the embedding (cosine) of the same MODEL, unexpired and at "
              "least THRESHOLD similar (default 0.95): id, similarity, model, tensor; or nil.",
              "<query_embedding_blob> [MODEL <id>] [THRESHOLD <cos>]"});
  r.Register({"KV.INFO", 1, kKv | kCmdReadOnly, 0, 0, 0, Info, "kv_cache",
              "The caller's entries, blob bytes, hits, misses, capacity, evictions, expired.", ""});
  r.Register({"KV.EVICT", 2, kKv | kCmdWrite, 0, 0, 0, Evict, "kv_cache",
              "Removes one entry, ALL, or the EXPIRED ones; replies how many.",
              "<id>|ALL|EXPIRED"});
}

}  // namespace pion::families
