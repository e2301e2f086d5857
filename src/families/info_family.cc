// INFO [section ...] and SLOWLOG GET|LEN|RESET|HELP.
//
// INFO reads the shards' counters and gauges (relaxed atomics) from the calling shard; it
// never stops another shard.
#include <sys/utsname.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>

#include "common/buffer.h"
#include "common/bytes.h"
#include "families/args.h"
#include "families/families.h"
#include "kernels/cuda/gpu.h"
#include "server/process_stats.h"
#include "server/server.h"

namespace pion::families {
namespace {

using proto::CmdArgs;
using server::CommandContext;
using server::Read;
using server::ShardStats;

constexpr const char* kVersion = "0.1.0";

void Kv(std::string& out, const char* key, const std::string& value) {
  out += key;
  out += ':';
  out += value;
  out += "\r\n";
}
void Kv(std::string& out, const char* key, uint64_t v) { Kv(out, key, std::to_string(v)); }
// A limit's bytes, or "unlimited" for none (0 on the command line).
std::string Limit(uint64_t v) { return v == 0 ? "unlimited" : std::to_string(v); }

void ServerSection(server::Server& srv, std::string& out) {
  out += "# Server\r\n";
  Kv(out, "pion_version", kVersion);
  Kv(out, "redis_version", "7.0.0");  // what RESP clients expect to parse; Pion speaks RESP3
  utsname u{};
  uname(&u);
  Kv(out, "os", std::string(u.sysname) + " " + u.release + " " + u.machine);
  Kv(out, "multiplexing_api", "epoll");
  Kv(out, "process_id", static_cast<uint64_t>(getpid()));
  Kv(out, "tcp_port", static_cast<uint64_t>(srv.port()));
  Kv(out, "binary_port", static_cast<uint64_t>(srv.binary_port()));  // 0: off
  Kv(out, "bind", srv.config().bind);
  Kv(out, "unixsocket", srv.config().unixsocket);
  auto up = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() -
                                                             srv.start_time())
                .count();
  Kv(out, "uptime_in_seconds", static_cast<uint64_t>(up));
  Kv(out, "uptime_in_days", static_cast<uint64_t>(up / 86400));
  Kv(out, "workers", static_cast<uint64_t>(srv.shard_count()));
  Kv(out, "kvcache", srv.config().kvcache ? "on" : "off");
  Kv(out, "config_file", srv.config().config_file);
  Kv(out, "metrics_port", static_cast<uint64_t>(srv.config().metrics_port));
  char exe[4096] = {0};
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  Kv(out, "executable", n > 0 ? std::string(exe, static_cast<size_t>(n)) : "");
}

void ClientsSection(server::Server& srv, std::string& out) {
  out += "# Clients\r\n";
  Kv(out, "connected_clients", srv.connected_clients());
  Kv(out, "maxclients", static_cast<uint64_t>(srv.settings().maxclients.load()));
  uint64_t biggest = 0, q = 0, o = 0;
  for (int i = 0; i < srv.shard_count(); ++i) {
    auto& sh = srv.shard(i);
    biggest = std::max<uint64_t>(biggest, sh.client_biggest_output.load());
    q += sh.client_query_bytes.load();
    o += sh.client_output_bytes.load();
  }
  Kv(out, "client_query_buffers_bytes", q);
  Kv(out, "client_output_buffers_bytes", o);
  Kv(out, "client_biggest_output_buffer", biggest);
  Kv(out, "client_output_buffer_limit", srv.settings().client_output_buffer_limit.load());
  Kv(out, "client_query_buffer_limit", srv.settings().client_query_buffer_limit.load());
}

void MemorySection(server::Server& srv, std::string& out) {
  auto& mem = srv.memory();
  out += "# Memory\r\n";
  Kv(out, "used_memory", mem.used());
  Kv(out, "used_memory_human", HumanBytes(mem.used()));
  uint64_t rss = server::ProcessRssBytes();
  Kv(out, "used_memory_rss", rss);
  Kv(out, "used_memory_rss_human", HumanBytes(rss));
  Kv(out, "used_memory_peak_rss", server::ProcessPeakRssBytes());
  Kv(out, "maxmemory", mem.maxmemory());
  Kv(out, "maxmemory_human", mem.maxmemory() == 0 ? "unlimited" : HumanBytes(mem.maxmemory()));
  Kv(out, "maxmemory_policy", "demote-lru");  // least recently used objects move to disk
  for (int f = 0; f < static_cast<int>(server::MemFamily::kCount); ++f) {
    auto fam = static_cast<server::MemFamily>(f);
    std::string key = "used_memory_" + std::string(server::MemFamilyName(fam));
    Kv(out, key.c_str(), mem.used(fam));
  }
  uint64_t clients = 0;
  for (int i = 0; i < srv.shard_count(); ++i) {
    clients += srv.shard(i).client_query_bytes.load() + srv.shard(i).client_output_bytes.load();
  }
  Kv(out, "used_memory_clients", clients);
  Kv(out, "buffer_cache_bytes", BufferAllocator::Default()->cached_bytes());
  Kv(out, "oom_rejections", mem.oom_rejections());
}

void StatsSection(server::Server& srv, std::string& out) {
  auto sum = [&srv](auto f) { return srv.SumStat(f); };
  out += "# Stats\r\n";
  Kv(out, "total_connections_received",
     sum([](const ShardStats& s) { return Read(s.connections_received); }));
  Kv(out, "total_commands_processed",
     sum([](const ShardStats& s) { return Read(s.commands_processed); }));
  Kv(out, "total_forwarded_commands",
     sum([](const ShardStats& s) { return Read(s.forwarded_commands); }));
  Kv(out, "total_net_input_bytes",
     sum([](const ShardStats& s) { return Read(s.net_input_bytes); }));
  Kv(out, "total_net_output_bytes",
     sum([](const ShardStats& s) { return Read(s.net_output_bytes); }));
  for (int r = 0; r < static_cast<int>(server::RejectReason::kCount); ++r) {
    std::string key =
        "rejected_" + std::string(server::RejectReasonName(static_cast<server::RejectReason>(r)));
    Kv(out, key.c_str(), sum([r](const ShardStats& s) { return Read(s.rejected[r]); }));
  }
  // Redis' names for the two most-watched ones.
  Kv(out, "rejected_connections", sum([](const ShardStats& s) {
       return Read(s.rejected[static_cast<int>(server::RejectReason::kMaxClients)]);
     }));
  Kv(out, "client_output_buffer_limit_disconnections", sum([](const ShardStats& s) {
       return Read(s.rejected[static_cast<int>(server::RejectReason::kOutputBufferLimit)]);
     }));
  uint64_t queued = 0;
  for (int i = 0; i < srv.shard_count(); ++i) queued += srv.shard(i).queued();
  Kv(out, "shard_queue_depth", static_cast<uint64_t>(srv.shard_queue_depth()));
  Kv(out, "shard_queued_commands", queued);
  Kv(out, "slowlog_len", static_cast<uint64_t>(srv.slowlog().Len()));
}

void CommandStatsSection(server::Server& srv, std::string& out) {
  out += "# Commandstats\r\n";
  for (const auto& spec : srv.registry().all()) {
    auto get = [&](std::atomic<uint64_t> server::CommandStats::*field) {
      return srv.SumStat([&](const ShardStats& s) { return Read(s.commands[spec.index].*field); });
    };
    uint64_t calls = get(&server::CommandStats::calls);
    uint64_t rejected = get(&server::CommandStats::rejected);
    if (calls == 0 && rejected == 0) continue;
    uint64_t usec = get(&server::CommandStats::usec);
    char line[256];
    std::snprintf(line, sizeof(line),
                  "cmdstat_%s:calls=%llu,usec=%llu,usec_per_call=%.2f,rejected_calls=%llu,"
                  "failed_calls=%llu\r\n",
                  spec.lower_name.c_str(), static_cast<unsigned long long>(calls),
                  static_cast<unsigned long long>(usec),
                  calls ? static_cast<double>(usec) / static_cast<double>(calls) : 0.0,
                  static_cast<unsigned long long>(rejected),
                  static_cast<unsigned long long>(get(&server::CommandStats::failed)));
    out += line;
  }
}

void PersistenceSection(server::Server& srv, std::string& out) {
  out += "# Persistence\r\n";
  auto& d = srv.disk_stats();
  Kv(out, "loading", uint64_t{0});
  Kv(out, "dir", srv.config().dir);
  Kv(out, "disk_objects_loaded", d.objects_loaded.load());
  Kv(out, "disk_objects_corrupt", d.objects_corrupt.load());
  Kv(out, "disk_saves", d.saves.load());
  Kv(out, "disk_save_failures", d.save_failures.load());
  Kv(out, "disk_warms", d.warms.load());
  const residency::Engine::Stats rs = srv.residency()->stats();
  // Objects that left memory for disk (written, or dropped with a disk copy in place), and
  // objects lost (their only copy failed validation): nothing is evicted any more.
  Kv(out, "disk_demotions", rs.demotions[1][2] + rs.drops[1]);
  Kv(out, "evictions", rs.lost_objects);
  Kv(out, "io_queued", static_cast<uint64_t>(srv.io() ? srv.io()->queued() : 0));
}

void KeyspaceSection(server::Server& srv, std::string& out) {
  out += "# Keyspace\r\n";
  uint64_t slots = 0, bytes = 0;
  for (int i = 0; i < srv.shard_count(); ++i) {
    auto t = srv.shard(i).store().state.Total();
    slots += t.slots;
    bytes += t.bytes;
  }
  Kv(out, "state", "slots=" + std::to_string(slots) + ",bytes=" + std::to_string(bytes));
  uint64_t sessions = 0, rows = 0, ssm_sessions = 0, blobs = 0, ssm_bytes = 0;
  for (int i = 0; i < srv.shard_count(); ++i) {
    auto v = srv.shard(i).store().vstore.Total();
    sessions += v.sessions;
    rows += v.rows;
    auto s = srv.shard(i).store().ssm.Total();
    ssm_sessions += s.sessions;
    blobs += s.blobs;
    ssm_bytes += s.bytes;
  }
  Kv(out, "vstore",
     "sessions=" + std::to_string(sessions) + ",rows=" + std::to_string(rows) +
         ",bytes=" + std::to_string(srv.memory().used(server::MemFamily::kVStore)));
  Kv(out, "ssm",
     "sessions=" + std::to_string(ssm_sessions) + ",blobs=" + std::to_string(blobs) +
         ",bytes=" + std::to_string(ssm_bytes));
}

void AttentionSection(server::Server& srv, std::string& out) {
  out += "# Attention\r\n";
  attention::SlotStore::Usage u;
  for (int i = 0; i < srv.shard_count(); ++i) {
    auto t = srv.shard(i).store().attention.Total();
    u.sessions += t.sessions;
    u.slots += t.slots;
    u.bytes += t.bytes;
  }
  const auto& c = srv.attention_counters();
  residency::Engine* e = srv.residency();
  Kv(out, "attention_backend", std::string(srv.attention_backend()));
  Kv(out, "attention_dtype", srv.config().attention_fp16 ? "fp16" : "fp32");
  Kv(out, "attention_sessions", u.sessions);
  Kv(out, "attention_slots", u.slots);
  Kv(out, "attention_bytes", u.bytes);  // the slots' K and V, in whichever tier
  // Host memory: slot copies, summaries, transient STORE FROM decodes (--attention-memory).
  Kv(out, "attention_host_bytes", srv.memory().used(server::MemFamily::kAttention));
  Kv(out, "attention_memory_limit",
     Limit(srv.memory().family_limit(server::MemFamily::kAttention)));
  Kv(out, "attention_stores", c.stores.load());
  Kv(out, "attention_stores_from", c.stores_from.load());
  Kv(out, "attention_promotions", c.promotions.load());
  Kv(out, "attention_misses", c.misses.load());
  for (int f = 0; f < attention::kFormCount; ++f) {
    const std::string key =
        "attention_queries_" + std::string(attention::FormName(static_cast<attention::Form>(f)));
    Kv(out, key.c_str(), c.queries[f].load());
  }
  Kv(out, "attention_exact", c.exact.load());
  Kv(out, "attention_approximate", c.approximate.load());
  Kv(out, "attention_rows_attended", c.rows_attended.load());
  Kv(out, "attention_compute_us", c.compute_us.load());
  Kv(out, "attention_queries_inline", c.inline_queries.load());
  Kv(out, "attention_cpu_fallbacks", c.cpu_fallbacks.load());
  Kv(out, "attention_approx_fallbacks", c.approx_fallbacks.load());
  Kv(out, "attention_gpu_device", srv.gpu_attention() ? gpu::Info().name : std::string());
  Kv(out, "attention_gpu_memory_limit", srv.gpu_attention() ? e->gpu_budget().limit() : 0);
  Kv(out, "attention_gpu_bytes", srv.gpu_attention() ? e->gpu_budget().used() : 0);
  Kv(out, "attention_gpu_upload_failures", c.gpu_upload_failures.load());
  server::WorkerPool* pool = srv.compute();
  Kv(out, "compute_threads", static_cast<uint64_t>(pool ? pool->threads() : 0));
  Kv(out, "compute_queue_depth", static_cast<uint64_t>(pool ? pool->capacity() : 0));
  Kv(out, "compute_queued", static_cast<uint64_t>(pool ? pool->queued() : 0));
  Kv(out, "compute_busy", static_cast<uint64_t>(pool ? pool->busy() : 0));
  Kv(out, "compute_completed", pool ? pool->completed() : 0);
  Kv(out, "compute_rejected", pool ? pool->rejected() : 0);
}

void ResidencySection(server::Server& srv, std::string& out) {
  out += "# Residency\r\n";
  residency::Engine* e = srv.residency();
  if (e == nullptr) return;
  const residency::Engine::Stats st = e->stats();
  using residency::Tier;
  auto tier = [](Tier t) { return static_cast<int>(t); };
  auto key = [](const std::string& k) { return k; };
  const char* names[] = {"gpu", "host", "disk"};
  for (int t = 0; t < residency::kTierCount; ++t) {
    Kv(out, key(std::string("residency_") + names[t] + "_objects").c_str(), st.tiers[t].objects);
    Kv(out, key(std::string("residency_") + names[t] + "_bytes").c_str(), st.tiers[t].bytes);
  }
  Kv(out, "residency_gpu_limit", e->gpu_budget().limit());
  Kv(out, "residency_gpu_used", e->gpu_budget().used());
  Kv(out, "residency_host_limit", Limit(srv.memory().maxmemory()));
  Kv(out, "residency_disk_quota", Limit(e->disk_quota().limit()));
  Kv(out, "residency_disk_used", e->disk_quota().used());
  auto pair = [&](const char* what, const uint64_t(&m)[3][3], int a, int b) {
    Kv(out, (std::string("residency_") + what + "_" + names[a] + "_" + names[b]).c_str(), m[a][b]);
  };
  pair("promotions", st.promotions, tier(Tier::kDisk), tier(Tier::kHost));
  pair("promotions", st.promotions, tier(Tier::kGpu), tier(Tier::kHost));
  pair("promotions", st.promotions, tier(Tier::kHost), tier(Tier::kGpu));
  pair("promotion_bytes", st.promotion_bytes, tier(Tier::kDisk), tier(Tier::kHost));
  pair("promotion_bytes", st.promotion_bytes, tier(Tier::kHost), tier(Tier::kGpu));
  pair("demotions", st.demotions, tier(Tier::kHost), tier(Tier::kDisk));
  pair("demotions", st.demotions, tier(Tier::kGpu), tier(Tier::kHost));
  pair("demotion_bytes", st.demotion_bytes, tier(Tier::kHost), tier(Tier::kDisk));
  pair("demotion_bytes", st.demotion_bytes, tier(Tier::kGpu), tier(Tier::kHost));
  for (int t = 0; t < residency::kTierCount; ++t) {
    Kv(out, (std::string("residency_drops_") + names[t]).c_str(), st.drops[t]);
  }
  Kv(out, "residency_backend_reads", st.backend_reads);
  Kv(out, "residency_coalesced", st.coalesced);
  Kv(out, "residency_room_waits", st.room_waits);
  Kv(out, "residency_corrupt_replicas", st.corrupt_replicas);
  Kv(out, "residency_lost_objects", st.lost_objects);
  Kv(out, "residency_spill_files", st.spill_files);
  Kv(out, "residency_promotion_inflight_bytes", st.inflight_promotion_bytes);
  Kv(out, "residency_promotion_credits", st.promotion_credits);
  const char* paths[] = {"disk_read", "disk_write", "gpu_upload", "gpu_download"};
  for (int p = 0; p < 4; ++p) {  // only what was measured (a guess is no rate)
    if (!st.rate_measured[p]) continue;
    Kv(out, (std::string("residency_rate_") + paths[p]).c_str(), static_cast<uint64_t>(st.rate[p]));
  }
  // Refusals by the stage that refused and why (only those that happened), and their total.
  uint64_t total = 0;
  for (int a = 0; a < residency::kStageCount; ++a) {
    for (int b = 0; b < residency::kRefusalCount; ++b) {
      if (st.refusals[a][b] == 0) continue;
      total += st.refusals[a][b];
      Kv(out,
         ("residency_refused_" +
          std::string(residency::StageName(static_cast<residency::Stage>(a))) + "_" +
          std::string(residency::RefusalName(static_cast<residency::Refusal>(b))))
             .c_str(),
         st.refusals[a][b]);
    }
  }
  Kv(out, "residency_refused", total);
}

// As Redis: cluster clients (redis-py's RedisCluster) check cluster_enabled; the rest of the
// cluster's state is CLUSTER INFO's.
void ClusterSection(server::Server& srv, std::string& out) {
  out += "# Cluster\r\n";
  Kv(out, "cluster_enabled", srv.cluster() != nullptr ? 1 : 0);
}

struct Section {
  const char* name;
  void (*render)(server::Server&, std::string&);
  bool in_default;
};
constexpr Section kSections[] = {
    {"server", ServerSection, true},       {"clients", ClientsSection, true},
    {"memory", MemorySection, true},       {"persistence", PersistenceSection, true},
    {"stats", StatsSection, true},         {"commandstats", CommandStatsSection, false},
    {"keyspace", KeyspaceSection, true},   {"attention", AttentionSection, true},
    {"residency", ResidencySection, true}, {"cluster", ClusterSection, true},
};

void Info(CommandContext& ctx, CmdArgs& args) {
  bool all = false, defaults = args.size() == 1;
  std::vector<std::string_view> wanted;
  for (size_t i = 1; i < args.size(); ++i) {
    if (EqualsIgnoreCase(args[i], "all") || EqualsIgnoreCase(args[i], "everything")) {
      all = true;
    } else if (EqualsIgnoreCase(args[i], "default")) {
      defaults = true;
    } else {
      wanted.push_back(args[i]);
    }
  }
  std::string out;
  for (const auto& s : kSections) {
    bool on = all || (defaults && s.in_default);
    for (auto w : wanted) on = on || EqualsIgnoreCase(w, s.name);
    if (!on) continue;
    if (!out.empty()) out += "\r\n";
    s.render(*ctx.server, out);
  }
  ctx.rb->Verbatim(out);
}

void Slowlog(CommandContext& ctx, CmdArgs& args) {
  auto& rb = *ctx.rb;
  auto& log = ctx.server->slowlog();
  std::string_view sub = args[1];
  if (EqualsIgnoreCase(sub, "GET") && args.size() <= 3) {
    int64_t count = 10;
    if (args.size() == 3) {
      if (!ParseInt64(args[2], &count) || count < -1) {
        rb.ErrorLine("ERR count should be greater than or equal to -1");
        return;
      }
    }
    auto entries = log.Get(count < 0 ? SIZE_MAX : static_cast<size_t>(count));
    rb.Array(entries.size());
    for (const auto& e : entries) {
      rb.Array(6);
      rb.Integer(static_cast<int64_t>(e.id));
      rb.Integer(e.unix_time);
      rb.Integer(static_cast<int64_t>(e.duration_us));
      rb.Array(e.args.size());
      for (const auto& a : e.args) rb.Bulk(a);
      rb.Bulk(e.peer);
      rb.Bulk(e.client_name);
    }
  } else if (EqualsIgnoreCase(sub, "LEN") && args.size() == 2) {
    rb.Integer(static_cast<int64_t>(log.Len()));
  } else if (EqualsIgnoreCase(sub, "RESET") && args.size() == 2) {
    log.Reset();
    rb.Ok();
  } else if (EqualsIgnoreCase(sub, "HELP") && args.size() == 2) {
    static const char* kHelp[] = {
        "SLOWLOG <subcommand> [<arg> ...]. Subcommands are:",
        "GET [<count>]",
        "    Return top <count> entries from the slowlog (default: 10, -1 all).",
        "LEN",
        "    Return the length of the slowlog.",
        "RESET",
        "    Reset the slowlog.",
        "HELP",
        "    Print this help."};
    rb.Array(std::size(kHelp));
    for (const char* l : kHelp) rb.SimpleString(l);
  } else {
    rb.ErrorLine(server::UnknownSubcommandError(sub, "slowlog"));
  }
}

}  // namespace

void RegisterInfoFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  r.Register({"INFO", -1, 0, 0, 0, 0, Info, "server",
              "Server information and statistics by section.",
              "[server|clients|memory|persistence|stats|commandstats|keyspace|attention|residency|"
              "all ...]"});
  r.Register({"SLOWLOG", -2, kCmdAdmin, 0, 0, 0, Slowlog, "server",
              "Reads or resets the log of slow commands.", "GET [count]|LEN|RESET|HELP"});
}

}  // namespace pion::families
