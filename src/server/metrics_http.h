// MetricsHttp: Prometheus text exposition on --metrics-port (GET /metrics).
//
// Runs on its own thread with a small poll() loop; a scrape reads the shards' relaxed
// counters, so it never stops the data path. Label sets are bounded: command names come from
// the command table, reasons and memory families from fixed enums — never session ids.
#pragma once

#include <atomic>
#include <string>
#include <thread>

#include "common/status.h"

namespace pion::server {

class Server;

class MetricsHttp {
 public:
  explicit MetricsHttp(Server* server) : server_(server) {}
  ~MetricsHttp();

  Status Listen(const std::string& host, int port);
  void Start();
  void Stop();

  // The exposition text (also used by tests).
  static std::string Render(Server& server);

 private:
  void Run();
  void Serve(int fd);

  Server* server_;
  int listen_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};
};

}  // namespace pion::server
