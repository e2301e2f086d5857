#include "server/server.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <ctime>
#include <filesystem>

#include "common/bytes.h"
#include "kernels/cuda/gpu.h"
#include "net/socket.h"
#include "server/metrics_http.h"

namespace pion::server {

Server::Server(Config config) : config_(std::move(config)), settings_(config_) {
  memory_.set_maxmemory(config_.maxmemory);
}

MemFamily Server::MemFamilyOf(residency::Family f) {
  switch (f) {
    case residency::Family::kState:
      return MemFamily::kState;
    case residency::Family::kSsm:
      return MemFamily::kSsm;
    case residency::Family::kVStore:
      return MemFamily::kVStore;
    case residency::Family::kAttention:
      return MemFamily::kAttention;
    case residency::Family::kCount:
      break;
  }
  return MemFamily::kState;
}

namespace {

// --disk-quota auto: what Pion already keeps under `dir` plus 90 % of the file system's free
// space there.
uint64_t AutoDiskQuota(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  uint64_t used = 0;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec)) used += it->file_size(ec);
  }
  struct statvfs st {};
  if (statvfs(dir.c_str(), &st) != 0) return 0;
  const uint64_t free = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  return used + free / 10 * 9;
}

}  // namespace

Server::~Server() {
  if (shm_) shm_->Clear();
  if (listen_fd_ >= 0) close(listen_fd_);
  if (binary_fd_ >= 0) close(binary_fd_);
  if (unix_fd_ >= 0) {
    close(unix_fd_);
    unlink(config_.unixsocket.c_str());
  }
}

Status Server::Init() {
  if (!config_.users_file.empty()) {
    Status s = users_.LoadFile(config_.users_file);
    if (!s.ok()) return Fail(kExitUsage, s);
  }
  if (!config_.requirepass.empty()) users_.SetDefaultPassword(config_.requirepass);

  auto fd = net::ListenTcp(config_.bind, config_.port);
  if (!fd.ok()) return Fail(kExitListen, fd.status());
  listen_fd_ = fd.value();
  std::string local = net::SocketAddress(listen_fd_, /*local=*/true);
  bound_port_ = std::stoi(local.substr(local.rfind(':') + 1));
  if (config_.binary_port != 0) {
    auto bfd = net::ListenTcp(config_.bind, config_.binary_port);
    if (!bfd.ok()) return Fail(kExitListen, bfd.status());
    binary_fd_ = bfd.value();
    std::string blocal = net::SocketAddress(binary_fd_, /*local=*/true);
    bound_binary_port_ = std::stoi(blocal.substr(blocal.rfind(':') + 1));
  }
  if (!config_.unixsocket.empty()) {
    auto ufd = net::ListenUnix(config_.unixsocket, config_.unixsocketperm);
    if (!ufd.ok()) return Fail(kExitListen, ufd.status());
    unix_fd_ = ufd.value();
  }

  // The attention backend: slots on the GPU (cuda) or in host memory (cpu).
  const gpu::DeviceInfo& dev = gpu::Info();
  if (config_.attention_backend == "cuda" && !dev.present) {
    return Fail(kExitGpu, Error("--attention-backend cuda: no usable CUDA device (" + dev.reason +
                                "); use --attention-backend cpu or auto"));
  }
  uint64_t gpu_limit = 0;
  if (config_.attention_backend == "cuda" || (config_.attention_backend == "auto" && dev.present)) {
    gpu_limit = config_.gpu_memory != 0 ? config_.gpu_memory : dev.free_bytes / 10 * 9;
    gpu_attention_ = true;
    const uint64_t limit = gpu_limit;
    spdlog::info("attention on {} (sm_{}{}, {} SMs): {} MiB for slots", dev.name, dev.cc_major,
                 dev.cc_minor, dev.sms, limit >> 20);
  }

  if (gpu_attention_) gpu_copy_ = std::make_unique<WorkerPool>(2, 1024);

  // The residency engine: host budgets are the accountant's families; the GPU tier exists
  // with the cuda backend.
  residency::EngineOptions eo;
  eo.gpu_limit = gpu_limit;
  eo.disk_quota = config_.disk_quota_auto ? AutoDiskQuota(config_.dir) : config_.disk_quota;
  eo.spill_dir = config_.dir + "/spill";
  eo.promotion_credits = config_.promotion_credits;
  for (int f = 0; f < residency::kFamilyCount; ++f) {
    eo.host[f] = memory_.BudgetFor(MemFamilyOf(static_cast<residency::Family>(f)));
  }
  eo.host_headroom = [this](residency::Family f) { return memory_.Headroom(MemFamilyOf(f)); };
  eo.host_headroom_any = [this] { return memory_.free_bytes(); };
  eo.run_io = [this](std::function<void()> job) { return io_->Submit(std::move(job)); };
  if (gpu_attention_) {
    eo.run_gpu = [this](std::function<void()> job) { return gpu_copy_->Submit(std::move(job)); };
  }
  engine_ = std::make_unique<residency::Engine>(std::move(eo));
  {
    Status s = engine_->Start();
    if (!s.ok()) return Fail(kExitDataDir, s);
  }
  for (int f = 0; f < residency::kFamilyCount; ++f) {
    const auto fam = static_cast<residency::Family>(f);
    memory_.SetReclaimer(MemFamilyOf(fam), [this, fam](uint64_t need, bool family_only) {
      return engine_->ReclaimClean(residency::Tier::kHost,
                                   family_only ? std::optional(fam) : std::nullopt, need);
    });
  }
  shm_ =
      std::make_unique<ShmPlane>(unix_fd_ >= 0, config_.shm_segment_size, config_.shm_lease_ttl_ms,
                                 static_cast<size_t>(config_.shm_max_leases));
  for (int i = 0; i < config_.workers; ++i) {
    shards_.push_back(std::make_unique<Shard>(this, i, listen_fd_, unix_fd_, binary_fd_,
                                              registry_.size(),
                                              static_cast<size_t>(config_.shard_queue_depth)));
    shards_.back()->set_poll_us(config_.poll_us);
    for (auto& hook : shard_inits_) hook(*shards_.back());
    shards_.back()->store().vstore.set_allocator(
        [this](uint32_t tenant) { return shm_->AllocatorFor(tenant); });
  }
  io_ = std::make_unique<WorkerPool>(config_.io_threads, 1024);
  compute_ = std::make_unique<WorkerPool>(config_.compute_threads,
                                          static_cast<size_t>(config_.compute_queue_depth));
  for (auto& [hook, exit_code] : startup_) {
    Status s = hook(*this);
    if (!s.ok()) return Fail(exit_code, s);
  }
  if (config_.metrics_port != 0) {
    metrics_ = std::make_unique<MetricsHttp>(this);
    Status s = metrics_->Listen(config_.bind, config_.metrics_port);
    if (!s.ok()) return Fail(kExitListen, s);
  }
  return Status::Ok();
}

int Server::Run() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // shards inherit the mask; only main waits
  signal(SIGPIPE, SIG_IGN);

  start_time_ = std::chrono::steady_clock::now();
  for (auto& s : shards_) s->Start();
  if (metrics_) metrics_->Start();
  spdlog::info("{}", ReadyLine());
  timespec timeout{0, 100 * 1000 * 1000};
  while (!shutting_down()) {
    int sig = sigtimedwait(&set, nullptr, &timeout);
    if (sig == SIGINT || sig == SIGTERM) {
      spdlog::info("received {}, shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
      RequestShutdown();
    }
  }
  for (auto& hook : shutdown_hooks_) hook();
  for (auto& s : shards_) s->Stop();
  for (auto& s : shards_) s->Join();
  for (auto& hook : exit_hooks_) hook(*this);
  if (metrics_) metrics_->Stop();  // it reads the pools' counters: stop it before they go
  compute_.reset();                // finishes queued queries (their replies have nowhere to go)
  io_.reset();  // finishes queued disk work (their replies have nowhere to go; the data does)
  gpu_copy_.reset();
  spdlog::info("Pion is now ready to exit, bye bye");
  return 0;
}

std::string Server::ReadyLine() const {
  // host:port with an IPv6 host in brackets, as a client writes it.
  auto addr = [this](int port) {
    const std::string& h = config_.bind;
    return (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + std::to_string(port);
  };
  auto limit = [](uint64_t v) { return v == 0 ? std::string("unlimited") : HumanBytes(v); };
  std::error_code ec;
  const std::string dir = std::filesystem::absolute(config_.dir, ec).lexically_normal().string();
  std::string line = "Pion ready: RESP on " + addr(bound_port_);
  if (unix_fd_ >= 0) line += " and " + config_.unixsocket;
  if (binary_fd_ >= 0) line += ", binary protocol on " + addr(bound_binary_port_);
  if (metrics_) line += ", metrics on http://" + addr(config_.metrics_port) + "/metrics";
  line += "; data dir " + (ec ? config_.dir : dir);
  line += "; maxmemory " + limit(memory_.maxmemory()) + (config_.maxmemory_auto ? " (auto)" : "");
  line += ", disk-quota " + limit(engine_ ? engine_->disk_quota().limit() : 0) +
          (config_.disk_quota_auto ? " (auto)" : "");
  line += ", gpu-memory " + (gpu_attention_ ? HumanBytes(engine_->gpu_budget().limit()) +
                                                  (config_.gpu_memory == 0 ? " (auto)" : "")
                                            : std::string("none (attention on the cpu)"));
  line += "; " + std::to_string(shards_.size()) + " shard(s), kvcache " +
          (config_.kvcache ? "on" : "off");
  return line;
}

void Server::RequestShutdown() { shutdown_.store(true, std::memory_order_release); }

int Server::OwnerOf(uint32_t tenant, std::string_view key) const {
  if (shards_.size() == 1) return 0;
  auto open = key.find('{');
  if (open != std::string_view::npos) {
    auto close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  uint64_t h = XXH3_64bits_withSeed(key.data(), key.size(), tenant);
  return static_cast<int>(h % shards_.size());
}

uint64_t Server::connected_clients() const {
  return SumStat([](const ShardStats& s) { return Read(s.connected_clients); });
}

uint64_t Server::SumStat(const std::function<uint64_t(const ShardStats&)>& f) const {
  uint64_t sum = 0;
  for (const auto& s : shards_) sum += f(s->stats());
  return sum;
}

void Server::FanOut(Shard& origin, net::Connection& conn, ShardQuery query, FanOutDone done) {
  struct State {
    std::vector<std::string> parts;
    std::atomic<int> left;
    ShardQuery query;
    FanOutDone done;
    int origin;
    uint64_t conn_id;
    int resp;
  };
  auto st = std::make_shared<State>();
  st->parts.resize(shards_.size());
  st->left.store(static_cast<int>(shards_.size()));
  st->query = std::move(query);
  st->done = std::move(done);
  st->origin = origin.id();
  st->conn_id = conn.id();
  st->resp = conn.resp_version();
  conn.BeginAsync();
  for (auto& s : shards_) {
    s->PostControl([this, st](Shard& shard) {
      st->parts[shard.id()] = st->query(shard);
      if (st->left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
      shards_[st->origin]->PostControl([st](Shard& home) {
        net::Connection* c = home.FindConnection(st->conn_id);
        if (c == nullptr) return;
        proto::ReplyBuffer buf;
        proto::ReplyBuilder rb(&buf, st->resp);
        st->done(st->parts, rb);
        c->CompleteAsync(std::move(buf));
      });
    });
  }
}

}  // namespace pion::server
