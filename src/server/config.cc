#include "server/config.h"

#include <toml++/toml.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "common/bytes.h"

namespace pion::server {
namespace {

constexpr const char* kVersion = "0.1.0";

// CLI11 validator/transform for byte sizes ("512mb", "2gb").
// A size without a unit is bytes: one under 1 MiB (`--maxmemory 10`) is most likely a unit left
// out, so it is said on stderr (the value is taken as given).
void WarnUnitless(const std::string& name, const std::string& v, uint64_t bytes) {
  if (bytes == 0 || bytes >= (uint64_t{1} << 20)) return;
  if (v.find_first_not_of("0123456789") != std::string::npos) return;  // it has a unit
  std::fprintf(stderr,
               "pion-server: warning: %s %s is %s bytes (a size without a unit is in bytes); "
               "write %smb or %sgb if that was meant\n",
               name.c_str(), v.c_str(), v.c_str(), v.c_str(), v.c_str());
}

void AddSize(CLI::App& app, const std::string& name, uint64_t* target, const std::string& help) {
  app.add_option_function<std::string>(
         name,
         [target, name](const std::string& v) {
           auto parsed = ParseByteSize(v);
           if (!parsed) throw CLI::ValidationError(name, "expected a size like 512mb, got " + v);
           WarnUnitless(name, v, *parsed);
           *target = *parsed;
         },
         help + " (bytes; units b/kb/mb/gb/tb, decimals allowed: 1.5gb)")
      ->default_str(std::to_string(*target));
}

// A size that may also be "auto" (*is_auto then, resolved later).
void AddSizeOrAuto(CLI::App& app, const std::string& name, uint64_t* target, bool* is_auto,
                   const std::string& help) {
  app.add_option_function<std::string>(
         name,
         [target, is_auto, name](const std::string& v) {
           if (v == "auto") {
             *is_auto = true;
             return;
           }
           auto parsed = ParseByteSize(v);
           if (!parsed) {
             throw CLI::ValidationError(name, "expected a size like 512mb or auto, got " + v);
           }
           WarnUnitless(name, v, *parsed);
           *target = *parsed;
           *is_auto = false;
         },
         help + " (bytes; units b/kb/mb/gb/tb, decimals allowed: 1.5gb; or auto)")
      ->default_str("auto");
}

// Physical memory the process may use: MemTotal, or a lower cgroup (v2 or v1) limit.
uint64_t UsableMemory() {
  uint64_t total = 0;
  if (FILE* f = std::fopen("/proc/meminfo", "r")) {
    char key[64];
    unsigned long long kb = 0;
    while (std::fscanf(f, "%63s %llu kB\n", key, &kb) == 2) {
      if (std::string(key) == "MemTotal:") {
        total = kb * 1024;
        break;
      }
    }
    std::fclose(f);
  }
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    if (FILE* f = std::fopen(path, "r")) {
      unsigned long long v = 0;
      if (std::fscanf(f, "%llu", &v) == 1 && v > 0 && (total == 0 || v < total)) total = v;
      std::fclose(f);
    }
  }
  return total;
}

// Turns a TOML table into "--key=value" arguments placed before the real ones.
Status TomlToArgs(const std::string& path, std::vector<std::string>* out) {
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& err) {
    return Error("cannot parse config file " + path + ": " + std::string(err.description()) +
                 " at line " + std::to_string(err.source().begin.line));
  }
  for (const auto& [key, node] : table) {
    std::string value;
    if (auto s = node.value<std::string>()) {
      value = *s;
    } else if (auto i = node.value<int64_t>()) {
      value = std::to_string(*i);
    } else if (auto b = node.value<bool>()) {
      value = *b ? "on" : "off";
    } else {
      return Error("config file " + path + ": key '" + std::string(key.str()) +
                   "' must be a string, integer or boolean");
    }
    out->push_back("--" + std::string(key.str()) + "=" + value);
  }
  return Status::Ok();
}

}  // namespace

StatusOr<Config> ParseConfig(int argc, char** argv, int* exit_code, bool* should_exit) {
  Config c;
  *should_exit = false;
  CLI::App app{"pion-server: shared inference-state server (K/V prefixes, attention, SSM state)",
               "pion-server"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_version_flag("--version", kVersion);
  app.get_formatter()->column_width(40);

  app.add_option("--config", c.config_file, "TOML file with the same keys as these flags");
  app.add_option("--bind", c.bind, "Address to listen on")->capture_default_str();
  app.add_option("--port", c.port, "RESP port")->capture_default_str()->check(CLI::Range(1, 65535));
  app.add_option("--binary-port", c.binary_port,
                 "Port of the 0xCA5E binary protocol on --bind; 0 disables")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--unixsocket", c.unixsocket,
                 "Also listen on this Unix-domain socket path (same-host clients); empty = off");
  app.add_option_function<std::string>(
         "--unixsocketperm",
         [&c](const std::string& v) {
           char* end = nullptr;
           unsigned long perm = std::strtoul(v.c_str(), &end, 8);
           if (v.empty() || *end != '\0' || perm > 0777) {
             throw CLI::ValidationError("--unixsocketperm",
                                        "expected octal permissions like 700, got " + v);
           }
           c.unixsocketperm = static_cast<unsigned>(perm);
         },
         "Permissions of the --unixsocket file (octal)")
      ->default_str("700");
  AddSize(app, "--shm-segment-size", &c.shm_segment_size,
          "Size of each shared-memory segment of a tenant's values (with --unixsocket)");
  app.add_option("--shm-lease-ttl-ms", c.shm_lease_ttl_ms,
                 "A shared-memory lease not released within this time is released")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{86400000}));
  app.add_option("--shm-max-leases", c.shm_max_leases, "Leases one client may hold at once")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("-w,--workers", c.workers, "Shards (threads); 0 = number of cores")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  app.add_option("--dir", c.dir, "Data directory for the disk tier")->capture_default_str();
  AddSizeOrAuto(app, "--maxmemory", &c.maxmemory, &c.maxmemory_auto,
                "Host memory for stored data; beyond it the least recently used objects move to "
                "disk; auto = 3/4 of the machine's (or cgroup's) memory, 0 = no limit");
  AddSizeOrAuto(app, "--disk-quota", &c.disk_quota, &c.disk_quota_auto,
                "Bytes of saved and spill files under --dir; auto = what is there at start plus "
                "90% of the free space, 0 = no limit");
  AddSize(app, "--promotion-credits", &c.promotion_credits,
          "Bytes of promotions (disk -> host -> GPU) in flight; beyond it new ones get -BUSY");
  app.add_option("--default-deadline-ms", c.default_deadline_ms,
                 "Deadline of bulk and attention requests that name no DEADLINE; 0 = none")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{86400000}));
  app.add_option("--metrics-port", c.metrics_port,
                 "Prometheus /metrics HTTP port on --bind; 0 disables")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--requirepass", c.requirepass,
                 "Password of the 'default' user (tenant 'default'); enables AUTH");
  app.add_option("--users", c.users_file,
                 "Users file: lines of '<user> <password> <tenant>'; enables AUTH")
      ->check(CLI::ExistingFile);
  AddSize(app, "--proto-max-bulk-len", &c.proto_max_bulk_len, "Largest bulk argument accepted");
  app.add_option("--max-multibulk-len", c.max_multibulk_len, "Most arguments in one command")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  AddSize(app, "--client-query-buffer-limit", &c.client_query_buffer_limit,
          "Most bytes one client may have buffered for the command being received");
  AddSize(app, "--client-output-buffer-limit", &c.client_output_buffer_limit,
          "Pending reply bytes at which a client is paced, and disconnected if it stops reading");
  app.add_option("--client-output-buffer-timeout-ms", c.client_output_buffer_timeout_ms,
                 "How long a client may sit at its output limit without reading")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{86400000}));
  app.add_option("--maxclients", c.maxclients, "Most simultaneous client connections")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  app.add_option("--poll-us", c.poll_us,
                 "After activity, how long a shard polls before it sleeps (µs; 0 = never; -1 = "
                 "100 with 8 or more cores, else 0): lower cross-shard latency for some CPU")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{-1}, int64_t{1000000}));
  app.add_option("--shard-queue-depth", c.shard_queue_depth,
                 "Capacity of each shard's inbox; a full inbox answers -BUSY")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--io-threads", c.io_threads,
                 "Threads for disk-tier reads and writes (no event loop waits on the disk)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--attention-backend", c.attention_backend,
                 "Where ATTEND.PREFIX.* slots live and compute: cpu | cuda | auto (auto = cuda "
                 "when a GPU is present, else cpu)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_flag("--attention-fp16", c.attention_fp16,
               "Store attention slots as fp16 (half the memory; parity with fp16 engines)");
  AddSize(app, "--gpu-memory", &c.gpu_memory,
          "cuda backend: GPU memory for attention slots (the least recently used move to host "
          "memory beyond it); 0 = 90% of the device memory free at start");
  AddSize(app, "--attention-memory", &c.attention_memory,
          "Cap on attention slots in host memory (the least recently used move to disk beyond "
          "it); 0 = only --maxmemory");
  app.add_option("--kv-cache-capacity", c.kv_cache_capacity,
                 "KV.STORE entries kept per tenant; beyond it the least recently used go")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 32));
  app.add_option("--compute-threads", c.compute_threads,
                 "Threads that run attention queries; 0 = number of cores")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  app.add_option("--compute-queue-depth", c.compute_queue_depth,
                 "Queries that may wait for a compute thread; beyond it -BUSY")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  // An on|off flag (a bare flag is on).
  auto on_off = [&app](const char* name, bool* out, const char* help) {
    app.add_option_function<std::string>(
           name,
           [name, out](const std::string& v) {
             if (v.empty() || v == "on" || v == "yes" || v == "true" || v == "1") {
               *out = true;
             } else if (v == "off" || v == "no" || v == "false" || v == "0") {
               *out = false;
             } else {
               throw CLI::ValidationError(name, "expected on|off, got " + v);
             }
           },
           help)
        ->default_str(*out ? "on" : "off")
        ->expected(0, 1)
        ->default_val(*out ? "on" : "off");
  };
  on_off("--kvcache", &c.kvcache,
         "K/V cache families (KV.*, V.*, ATTEND.*, STATE.*, SSM.*): on|off");
  on_off("--fetch-copies", &c.fetch_copies,
         "V.FETCH ... HEADS / AS keeps the rows it shapes for later reads of them: on|off");
  app.add_option("--loglevel", c.loglevel, "trace|debug|info|warn|error")
      ->capture_default_str()
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  app.add_option("--logfile", c.logfile, "Log file; empty logs to stderr");
  app.add_option("--slowlog-log-slower-than", c.slowlog_log_slower_than_us,
                 "Microseconds; commands slower than this enter SLOWLOG (-1 disables)")
      ->capture_default_str();
  app.add_option("--slowlog-max-len", c.slowlog_max_len, "SLOWLOG entries kept")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));

  app.add_option("--cluster", c.cluster,
                 "Run as a cluster node: etcd://host:port of the etcd that holds membership, the "
                 "slot map and leases (empty = a single node, no etcd)");
  app.add_option("--cluster-name", c.cluster_name,
                 "Name of the cluster in etcd (keys under /pion/<name>/)")
      ->capture_default_str();
  app.add_option("--node-id", c.node_id,
                 "This node's name in the cluster: 1-64 of [A-Za-z0-9_.-] (needed with --cluster)");
  app.add_option("--announce", c.announce,
                 "host:port where clients and other nodes reach this node (default: bind:port)");
  app.add_option("--replicas", c.replicas,
                 "Nodes that keep a copy of each saved object besides its owner")
      ->capture_default_str()
      ->check(CLI::Range(0, 8));
  app.add_option("--cluster-lease-ttl", c.cluster_lease_ttl_s,
                 "Seconds a node may be silent before its slots fail over to its replica")
      ->capture_default_str()
      ->check(CLI::Range(2, 300));

  // First pass: find --config, then re-parse with the file's keys in front of argv.
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  std::string config_path;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size()) config_path = args[i + 1];
    if (args[i].rfind("--config=", 0) == 0) config_path = args[i].substr(9);
  }
  std::vector<std::string> full;
  if (!config_path.empty()) {
    Status s = TomlToArgs(config_path, &full);
    if (!s.ok()) return s;
  }
  full.insert(full.end(), args.begin(), args.end());
  std::reverse(full.begin(), full.end());  // CLI11 parses a reversed vector
  try {
    app.parse(full);
  } catch (const CLI::ParseError& e) {
    *should_exit = true;
    // --help and --version exit 0; every other parse error is a usage error (kExitUsage = 2).
    *exit_code = app.exit(e) == 0 ? 0 : 2;
    return Error("exit");
  }
  if (!c.cluster.empty()) {
    if (c.node_id.empty() || c.node_id.size() > 64 ||
        c.node_id.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                    "0123456789_.-") != std::string::npos) {
      return Error("--cluster needs --node-id of 1-64 characters of [A-Za-z0-9_.-], got '" +
                   c.node_id + "'");
    }
    if (c.cluster_name.empty() || c.cluster_name.find('/') != std::string::npos) {
      return Error("--cluster-name must be non-empty and without '/', got '" + c.cluster_name +
                   "'");
    }
  } else if (!c.node_id.empty() || !c.announce.empty()) {
    return Error("--node-id and --announce need --cluster etcd://host:port");
  }
  const unsigned hw = std::thread::hardware_concurrency();
  if (c.workers == 0) c.workers = hw == 0 ? 1 : static_cast<int>(hw);
  if (c.poll_us < 0) c.poll_us = hw >= 8 ? 100 : 0;
  if (c.compute_threads == 0) c.compute_threads = hw == 0 ? 1 : static_cast<int>(hw);
  if (c.maxmemory_auto) c.maxmemory = UsableMemory() / 4 * 3;
  return c;
}

RuntimeSettings::RuntimeSettings(const Config& c)
    : proto_max_bulk_len(c.proto_max_bulk_len),
      max_multibulk_len(c.max_multibulk_len),
      client_query_buffer_limit(c.client_query_buffer_limit),
      client_output_buffer_limit(c.client_output_buffer_limit),
      client_output_buffer_timeout_ms(c.client_output_buffer_timeout_ms),
      maxclients(c.maxclients),
      slowlog_log_slower_than_us(c.slowlog_log_slower_than_us),
      slowlog_max_len(c.slowlog_max_len),
      auth_required(!c.requirepass.empty() || !c.users_file.empty()),
      fetch_copies(c.fetch_copies),
      requirepass_(c.requirepass) {}

std::string RuntimeSettings::requirepass() const {
  std::lock_guard<std::mutex> lock(mu_);
  return requirepass_;
}

void RuntimeSettings::set_requirepass(std::string p) {
  std::lock_guard<std::mutex> lock(mu_);
  requirepass_ = std::move(p);
}

}  // namespace pion::server
