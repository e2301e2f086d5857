#include "server/metrics_http.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "net/socket.h"
#include "server/process_stats.h"
#include "server/server.h"

namespace pion::server {

namespace {

// A Prometheus label value: backslash, double quote and newline escaped.
std::string LabelValue(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

}  // namespace

MetricsHttp::~MetricsHttp() {
  Stop();
  if (listen_fd_ >= 0) close(listen_fd_);
}

Status MetricsHttp::Listen(const std::string& host, int port) {
  auto fd = net::ListenTcp(host, port, 64);
  if (!fd.ok()) return Status(fd.status().kind(), "metrics endpoint: " + fd.status().message());
  listen_fd_ = fd.value();
  return Status::Ok();
}

void MetricsHttp::Start() {
  thread_ = std::thread([this] { Run(); });
}

void MetricsHttp::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

void MetricsHttp::Run() {
  while (!stop_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Serve(fd);
    close(fd);
  }
}

void MetricsHttp::Serve(int fd) {
  // Read the request head (bounded size and time), answer, close.
  std::string req;
  char buf[4096];
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (req.find("\r\n\r\n") == std::string::npos && req.size() < 16384) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) return;
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    req.append(buf, static_cast<size_t>(n));
  }
  std::string status = "200 OK", body, type = "text/plain; version=0.0.4; charset=utf-8";
  if (req.rfind("GET /metrics", 0) == 0) {
    body = Render(*server_);
  } else if (req.rfind("GET / ", 0) == 0) {
    body = "pion-server metrics: GET /metrics\n";
  } else {
    status = "404 Not Found";
    body = "not found; try GET /metrics\n";
  }
  std::string resp = "HTTP/1.1 " + status + "\r\nContent-Type: " + type +
                     "\r\nContent-Length: " + std::to_string(body.size()) +
                     "\r\nConnection: close\r\n\r\n" + body;
  size_t off = 0;
  while (off < resp.size()) {
    ssize_t n = send(fd, resp.data() + off, resp.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

std::string MetricsHttp::Render(Server& server) {
  std::string out;
  out.reserve(64 * 1024);
  auto metric = [&out](const char* name, const char* type, const char* help) {
    out += "# HELP ";
    out += name;
    out += ' ';
    out += help;
    out += "\n# TYPE ";
    out += name;
    out += ' ';
    out += type;
    out += '\n';
  };
  auto line = [&out](const std::string& name_labels, uint64_t v) {
    out += name_labels;
    out += ' ';
    out += std::to_string(v);
    out += '\n';
  };
  // A limit: its bytes, or +Inf when there is none (0 on the command line).
  auto limit_line = [&out](const std::string& name_labels, uint64_t v) {
    out += name_labels;
    out += v == 0 ? " +Inf\n" : " " + std::to_string(v) + "\n";
  };

  metric("pion_uptime_seconds", "gauge", "Seconds since the server started.");
  line("pion_uptime_seconds",
       static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::seconds>(
                                 std::chrono::steady_clock::now() - server.start_time())
                                 .count()));
  metric("pion_connected_clients", "gauge", "Client connections currently open.");
  line("pion_connected_clients", server.connected_clients());
  metric("pion_connections_received_total", "counter", "Client connections accepted.");
  line("pion_connections_received_total",
       server.SumStat([](const ShardStats& s) { return Read(s.connections_received); }));
  metric("pion_net_input_bytes_total", "counter", "Bytes read from clients.");
  line("pion_net_input_bytes_total",
       server.SumStat([](const ShardStats& s) { return Read(s.net_input_bytes); }));
  metric("pion_net_output_bytes_total", "counter", "Bytes written to clients.");
  line("pion_net_output_bytes_total",
       server.SumStat([](const ShardStats& s) { return Read(s.net_output_bytes); }));
  metric("pion_forwarded_commands_total", "counter",
         "Commands handed to the shard owning their key.");
  line("pion_forwarded_commands_total",
       server.SumStat([](const ShardStats& s) { return Read(s.forwarded_commands); }));

  metric("pion_rejected_total", "counter", "Requests or connections refused, by reason.");
  for (int r = 0; r < static_cast<int>(RejectReason::kCount); ++r) {
    line("pion_rejected_total{reason=\"" +
             std::string(RejectReasonName(static_cast<RejectReason>(r))) + "\"}",
         server.SumStat([r](const ShardStats& s) { return Read(s.rejected[r]); }));
  }

  metric("pion_prefix_lookups_total", "counter",
         "KV.PREFIX.LOOKUP answers by tenant and result (hit, miss, mismatch): the prefix "
         "cache hit rate is hit / all.");
  for (size_t t = 0; t <= ShardStats::kLookupTenants; ++t) {
    std::array<uint64_t, static_cast<int>(PrefixLookup::kCount)> n{};
    uint64_t any = 0;
    for (int r = 0; r < static_cast<int>(PrefixLookup::kCount); ++r) {
      n[r] = server.SumStat([t, r](const ShardStats& s) { return Read(s.prefix_lookups[t][r]); });
      any += n[r];
    }
    if (any == 0 && t != 0) continue;  // the default tenant always, so the series exist
    const std::string tenant =
        t == ShardStats::kLookupTenants
            ? "_other"
            : LabelValue(server.users().TenantName(static_cast<uint32_t>(t)));
    for (int r = 0; r < static_cast<int>(PrefixLookup::kCount); ++r) {
      line("pion_prefix_lookups_total{tenant=\"" + tenant + "\",result=\"" +
               std::string(PrefixLookupName(static_cast<PrefixLookup>(r))) + "\"}",
           n[r]);
    }
  }

  auto& mem = server.memory();
  metric("pion_memory_used_bytes", "gauge", "Accounted memory by family.");
  for (int f = 0; f < static_cast<int>(MemFamily::kCount); ++f) {
    line("pion_memory_used_bytes{family=\"" +
             std::string(MemFamilyName(static_cast<MemFamily>(f))) + "\"}",
         mem.used(static_cast<MemFamily>(f)));
  }
  uint64_t client_bytes = 0;
  for (int i = 0; i < server.shard_count(); ++i) {
    client_bytes +=
        server.shard(i).client_query_bytes.load() + server.shard(i).client_output_bytes.load();
  }
  line("pion_memory_used_bytes{family=\"clients\"}", client_bytes);
  metric("pion_memory_max_bytes", "gauge", "--maxmemory (+Inf: no limit).");
  limit_line("pion_memory_max_bytes", mem.maxmemory());
  metric("pion_process_resident_bytes", "gauge", "Resident set size of the process.");
  line("pion_process_resident_bytes", ProcessRssBytes());

  const auto& ac = server.attention_counters();
  metric("pion_attention_queries_total", "counter", "ATTEND.PREFIX queries computed, by form.");
  for (int f = 0; f < attention::kFormCount; ++f) {
    line("pion_attention_queries_total{form=\"" +
             std::string(attention::FormName(static_cast<attention::Form>(f))) + "\"}",
         ac.queries[f].load());
  }
  metric("pion_attention_results_total", "counter", "ATTEND.PREFIX results by exactness.");
  line("pion_attention_results_total{kind=\"exact\"}", ac.exact.load());
  line("pion_attention_results_total{kind=\"approximate\"}", ac.approximate.load());
  metric("pion_attention_rows_attended_total", "counter", "Key rows attended, over query rows.");
  line("pion_attention_rows_attended_total", ac.rows_attended.load());
  metric("pion_attention_compute_microseconds_total", "counter", "Time spent computing attention.");
  line("pion_attention_compute_microseconds_total", ac.compute_us.load());
  metric("pion_attention_inline_queries_total", "counter",
         "Small host-memory queries computed on the shard thread (not the compute pool).");
  line("pion_attention_inline_queries_total", ac.inline_queries.load());
  uint64_t slots = 0;
  for (int i = 0; i < server.shard_count(); ++i)
    slots += server.shard(i).store().attention.Total().slots;
  metric("pion_attention_slots", "gauge", "ATTEND.PREFIX slots (in whichever tier).");
  line("pion_attention_slots", slots);
  metric("pion_attention_misses_total", "counter", "Queries on a slot that does not exist.");
  line("pion_attention_misses_total", ac.misses.load());
  metric("pion_attention_fallbacks_total", "counter",
         "Queries answered elsewhere than asked to meet their deadline, by kind.");
  line("pion_attention_fallbacks_total{kind=\"cpu\"}", ac.cpu_fallbacks.load());
  line("pion_attention_fallbacks_total{kind=\"approx\"}", ac.approx_fallbacks.load());
  if (server.gpu_attention()) {
    residency::Engine* e = server.residency();
    metric("pion_attention_gpu_bytes", "gauge", "GPU bytes held by slot copies and summaries.");
    line("pion_attention_gpu_bytes", e->gpu_budget().used());
    metric("pion_attention_gpu_memory_limit_bytes", "gauge", "--gpu-memory.");
    line("pion_attention_gpu_memory_limit_bytes", e->gpu_budget().limit());
    metric("pion_attention_gpu_upload_failures_total", "counter",
           "STOREs refused at the GPU stage (no room, device error).");
    line("pion_attention_gpu_upload_failures_total", ac.gpu_upload_failures.load());
  }
  if (residency::Engine* e = server.residency()) {
    const residency::Engine::Stats st = e->stats();
    const char* tiers[] = {"gpu", "host", "disk"};
    metric("pion_residency_objects", "gauge", "Objects with a replica in the tier.");
    for (int t = 0; t < residency::kTierCount; ++t) {
      line(std::string("pion_residency_objects{tier=\"") + tiers[t] + "\"}", st.tiers[t].objects);
    }
    metric("pion_residency_bytes", "gauge", "Bytes of the replicas in the tier.");
    for (int t = 0; t < residency::kTierCount; ++t) {
      line(std::string("pion_residency_bytes{tier=\"") + tiers[t] + "\"}", st.tiers[t].bytes);
    }
    metric("pion_residency_limit_bytes", "gauge",
           "The tier's budget: --gpu-memory, --maxmemory, --disk-quota (+Inf: no limit; no gpu "
           "series without a GPU tier).");
    if (server.gpu_attention()) {
      line("pion_residency_limit_bytes{tier=\"gpu\"}", e->gpu_budget().limit());
    }
    limit_line("pion_residency_limit_bytes{tier=\"host\"}", server.memory().maxmemory());
    limit_line("pion_residency_limit_bytes{tier=\"disk\"}", e->disk_quota().limit());
    metric("pion_residency_disk_used_bytes", "gauge", "Bytes of saved and spill files.");
    line("pion_residency_disk_used_bytes", e->disk_quota().used());
    auto moves = [&](const char* name, const char* help, const uint64_t(&m)[3][3]) {
      metric(name, "counter", help);
      for (int a = 0; a < residency::kTierCount; ++a) {
        for (int b = 0; b < residency::kTierCount; ++b) {
          if (a == b) continue;
          line(std::string(name) + "{from=\"" + tiers[a] + "\",to=\"" + tiers[b] + "\"}", m[a][b]);
        }
      }
    };
    moves("pion_residency_promotions_total", "Objects brought up a tier.", st.promotions);
    moves("pion_residency_promotion_bytes_total", "Bytes brought up a tier.", st.promotion_bytes);
    moves("pion_residency_demotions_total", "Objects moved down a tier.", st.demotions);
    moves("pion_residency_demotion_bytes_total", "Bytes moved down a tier.", st.demotion_bytes);
    metric("pion_residency_drops_total", "counter",
           "Replicas released because another tier also held the bytes.");
    for (int t = 0; t < residency::kTierCount; ++t) {
      line(std::string("pion_residency_drops_total{tier=\"") + tiers[t] + "\"}", st.drops[t]);
    }
    metric("pion_residency_backend_reads_total", "counter", "Disk blocks read by promotions.");
    line("pion_residency_backend_reads_total", st.backend_reads);
    metric("pion_residency_coalesced_total", "counter",
           "Requests that joined a promotion already in flight.");
    line("pion_residency_coalesced_total", st.coalesced);
    metric("pion_residency_corrupt_replicas_total", "counter",
           "Disk copies that failed validation (never served).");
    line("pion_residency_corrupt_replicas_total", st.corrupt_replicas);
    metric("pion_residency_lost_objects_total", "counter",
           "Objects whose only copy failed validation.");
    line("pion_residency_lost_objects_total", st.lost_objects);
    metric("pion_residency_promotion_inflight_bytes", "gauge",
           "Bytes of promotions in flight (--promotion-credits bounds them).");
    line("pion_residency_promotion_inflight_bytes", st.inflight_promotion_bytes);
    metric("pion_residency_refusals_total", "counter",
           "Requests refused, by the stage that refused them and why.");
    for (int a = 0; a < residency::kStageCount; ++a) {
      for (int b = 0; b < residency::kRefusalCount; ++b) {
        line("pion_residency_refusals_total{stage=\"" +
                 std::string(residency::StageName(static_cast<residency::Stage>(a))) +
                 "\",reason=\"" +
                 std::string(residency::RefusalName(static_cast<residency::Refusal>(b))) + "\"}",
             st.refusals[a][b]);
      }
    }
    metric("pion_residency_transfer_rate_bytes_per_second", "gauge",
           "Measured rate of each transfer path (what deadlines are admitted against); a path "
           "with no transfer yet has no series.");
    const char* paths[] = {"disk_read", "disk_write", "gpu_upload", "gpu_download"};
    for (int p = 0; p < 4; ++p) {
      if (!st.rate_measured[p]) continue;
      line(std::string("pion_residency_transfer_rate_bytes_per_second{path=\"") + paths[p] + "\"}",
           static_cast<uint64_t>(st.rate[p]));
    }
  }
  if (WorkerPool* pool = server.compute()) {
    metric("pion_compute_queued", "gauge", "Queries waiting for a compute thread.");
    line("pion_compute_queued", static_cast<uint64_t>(pool->queued()));
    metric("pion_compute_rejected_total", "counter", "Queries refused with -BUSY (queue full).");
    line("pion_compute_rejected_total", pool->rejected());
  }

  const auto& specs = server.registry().all();
  auto per_cmd = [&](const char* name, const char* help,
                     std::atomic<uint64_t> CommandStats::*field) {
    metric(name, "counter", help);
    for (const auto& spec : specs) {
      uint64_t v =
          server.SumStat([&](const ShardStats& s) { return Read(s.commands[spec.index].*field); });
      if (v > 0) line(std::string(name) + "{cmd=\"" + spec.lower_name + "\"}", v);
    }
  };
  per_cmd("pion_commands_total", "Commands executed.", &CommandStats::calls);
  per_cmd("pion_command_errors_total", "Commands that replied with an error.",
          &CommandStats::failed);
  per_cmd("pion_command_rejected_total", "Commands refused before running.",
          &CommandStats::rejected);

  metric("pion_command_duration_seconds", "histogram", "Command execution time.");
  for (const auto& spec : specs) {
    uint64_t calls =
        server.SumStat([&](const ShardStats& s) { return Read(s.commands[spec.index].calls); });
    if (calls == 0) continue;
    uint64_t cum = 0;
    std::string label = "{cmd=\"" + spec.lower_name + "\",le=\"";
    for (size_t b = 0; b <= kLatencyBucketsUs.size(); ++b) {
      cum += server.SumStat(
          [&](const ShardStats& s) { return Read(s.commands[spec.index].buckets[b]); });
      std::string le = b < kLatencyBucketsUs.size()
                           ? std::to_string(static_cast<double>(kLatencyBucketsUs[b]) / 1e6)
                           : "+Inf";
      if (le.find('.') != std::string::npos) {
        while (le.back() == '0') le.pop_back();
        if (le.back() == '.') le.pop_back();
      }
      line("pion_command_duration_seconds_bucket" + label + le + "\"}", cum);
    }
    uint64_t usec =
        server.SumStat([&](const ShardStats& s) { return Read(s.commands[spec.index].usec); });
    char sum[64];
    std::snprintf(sum, sizeof(sum), "%.6f", static_cast<double>(usec) / 1e6);
    out += "pion_command_duration_seconds_sum{cmd=\"" + spec.lower_name + "\"} " + sum + "\n";
    line("pion_command_duration_seconds_count{cmd=\"" + spec.lower_name + "\"}", calls);
  }
  return out;
}

}  // namespace pion::server
