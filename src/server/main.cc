// pion-server entry point: parse configuration, set up logging, register the command
// families, and run until SHUTDOWN or a signal.
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <filesystem>

#include "families/families.h"
#include "server/config.h"
#include "server/server.h"
#ifdef PION_FAULT_INJECTION
#include "faults/fault_family.h"
#endif

int main(int argc, char** argv) {
  int exit_code = 0;
  bool should_exit = false;
  auto config = pion::server::ParseConfig(argc, argv, &exit_code, &should_exit);
  if (should_exit) return exit_code;
  if (!config.ok()) {
    std::fprintf(stderr, "pion-server: %s\n", config.status().message().c_str());
    return pion::server::kExitUsage;
  }
  try {
    auto logger = config->logfile.empty() ? spdlog::stderr_color_mt("pion")
                                          : spdlog::basic_logger_mt("pion", config->logfile);
    spdlog::set_default_logger(logger);
  } catch (const spdlog::spdlog_ex& e) {
    std::fprintf(stderr, "pion-server: cannot open log file %s: %s\n", config->logfile.c_str(),
                 e.what());
    return pion::server::kExitLogFile;
  }
  spdlog::set_level(spdlog::level::from_str(config->loglevel));
  spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ [%t] %v");
  spdlog::flush_on(spdlog::level::info);

  // Saved objects stay open while their bytes may be read: allow as many files as the hard
  // limit does.
  rlimit nofile{};
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
  pion::server::Server server(std::move(config).value());
  pion::families::RegisterAll(server);
#ifdef PION_FAULT_INJECTION
  pion::faults::RegisterFaultFamily(server);  // test binary only
#endif
  pion::Status s = server.Init();
  if (!s.ok()) {
    spdlog::error("cannot start: {} (exit status {})", s.message(), server.init_exit_code());
    return server.init_exit_code();
  }
  return server.Run();
}
