// CONFIG GET|SET|RESETSTAT|HELP. Every setting is readable; the ones in RuntimeSettings (and
// maxmemory) can be changed while running, the rest are fixed at start-up.
#include <spdlog/spdlog.h>

#include <functional>

#include "families/args.h"
#include "families/families.h"
#include "server/server.h"

namespace pion::families {
namespace {

using proto::CmdArgs;
using server::CommandContext;

// Redis-style glob: * ? [abc] [a-z] [^x] and \ escapes, case-insensitive.
bool GlobMatch(std::string_view pat, std::string_view str) {
  auto lower = [](char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c; };
  size_t p = 0, s = 0, star_p = std::string_view::npos, star_s = 0;
  while (s < str.size()) {
    if (p < pat.size() && pat[p] == '*') {
      star_p = p++;
      star_s = s;
      continue;
    }
    if (p < pat.size()) {
      bool match = false;
      size_t next = p + 1;
      if (pat[p] == '?') {
        match = true;
      } else if (pat[p] == '[') {
        size_t q = p + 1;
        bool negate = q < pat.size() && pat[q] == '^';
        if (negate) ++q;
        bool in = false;
        while (q < pat.size() && pat[q] != ']') {
          if (q + 2 < pat.size() && pat[q + 1] == '-' && pat[q + 2] != ']') {
            if (lower(str[s]) >= lower(pat[q]) && lower(str[s]) <= lower(pat[q + 2])) in = true;
            q += 3;
          } else {
            if (lower(pat[q]) == lower(str[s])) in = true;
            ++q;
          }
        }
        match = in != negate;
        next = q < pat.size() ? q + 1 : q;
      } else if (pat[p] == '\\' && p + 1 < pat.size()) {
        match = lower(pat[p + 1]) == lower(str[s]);
        next = p + 2;
      } else {
        match = lower(pat[p]) == lower(str[s]);
      }
      if (match) {
        p = next;
        ++s;
        continue;
      }
    }
    if (star_p == std::string_view::npos) return false;
    p = star_p + 1;
    s = ++star_s;
  }
  while (p < pat.size() && pat[p] == '*') ++p;
  return p == pat.size();
}

struct Param {
  const char* name;
  std::function<std::string(server::Server&)> get;
  // Empty for immutable parameters. Validates v and, when apply is true, applies it.
  // Returns an error text or "".
  std::function<std::string(server::Server&, std::string_view v, bool apply)> set;
};

std::string SetSize(std::string_view v, bool apply, const std::function<void(uint64_t)>& set) {
  auto n = ParseByteSize(v);
  if (!n) return "argument must be a memory value";
  if (apply) set(*n);
  return "";
}

std::string SetInt(std::string_view v, int64_t lo, int64_t hi, bool apply,
                   const std::function<void(int64_t)>& set) {
  int64_t n;
  if (!ParseInt64(v, &n)) return "argument couldn't be parsed into an integer";
  if (n < lo || n > hi) {
    return "argument must be between " + std::to_string(lo) + " and " + std::to_string(hi) +
           " inclusive";
  }
  if (apply) set(n);
  return "";
}

// Our level names (the ones --loglevel accepts), not spdlog's ("warning", "err").
constexpr const char* kLogLevels[] = {"trace", "debug", "info", "warn", "error"};
std::string CurrentLogLevel() {
  switch (spdlog::get_level()) {
    case spdlog::level::trace:
      return "trace";
    case spdlog::level::debug:
      return "debug";
    case spdlog::level::info:
      return "info";
    case spdlog::level::warn:
      return "warn";
    default:
      return "error";
  }
}

const std::vector<Param>& Params() {
  using server::Server;
  static const std::vector<Param> kParams = {
      {"bind", [](Server& s) { return s.config().bind; }, nullptr},
      {"port", [](Server& s) { return std::to_string(s.config().port); }, nullptr},
      {"binary-port", [](Server& s) { return std::to_string(s.binary_port()); }, nullptr},
      {"unixsocket", [](Server& s) { return s.config().unixsocket; }, nullptr},
      {"unixsocketperm",
       [](Server& s) {
         char buf[8];
         std::snprintf(buf, sizeof(buf), "%o", s.config().unixsocketperm);
         return std::string(buf);
       },
       nullptr},
      {"workers", [](Server& s) { return std::to_string(s.shard_count()); }, nullptr},
      {"dir", [](Server& s) { return s.config().dir; }, nullptr},
      {"metrics-port", [](Server& s) { return std::to_string(s.config().metrics_port); }, nullptr},
      {"kvcache", [](Server& s) { return std::string(s.config().kvcache ? "on" : "off"); },
       nullptr},
      {"fetch-copies",
       [](Server& s) { return std::string(s.settings().fetch_copies.load() ? "on" : "off"); },
       [](Server& s, std::string_view v, bool apply) {
         bool on = false;
         if (EqualsIgnoreCase(v, "on") || EqualsIgnoreCase(v, "yes")) {
           on = true;
         } else if (!EqualsIgnoreCase(v, "off") && !EqualsIgnoreCase(v, "no")) {
           return std::string("argument must be on or off");
         }
         if (apply) s.settings().fetch_copies.store(on);
         return std::string();
       }},
      {"users", [](Server& s) { return s.config().users_file; }, nullptr},
      {"attention-backend", [](Server& s) { return std::string(s.attention_backend()); }, nullptr},
      {"gpu-memory",
       [](Server& s) {
         return std::to_string(s.gpu_attention() ? s.residency()->gpu_budget().limit() : 0);
       },
       [](Server& s, std::string_view v, bool apply) -> std::string {
         if (!s.gpu_attention()) {
           return "gpu-memory applies to --attention-backend cuda; this server computes on the "
                  "cpu";
         }
         return SetSize(v, apply, [&](uint64_t n) { s.residency()->SetGpuLimit(n); });
       }},
      {"attention-fp16",
       [](Server& s) { return std::string(s.config().attention_fp16 ? "yes" : "no"); }, nullptr},
      {"attention-memory",
       [](Server& s) {
         return std::to_string(s.memory().family_limit(server::MemFamily::kAttention));
       },
       [](Server& s, std::string_view v, bool apply) {
         return SetSize(v, apply, [&](uint64_t n) {
           s.memory().set_family_limit(server::MemFamily::kAttention, n);
         });
       }},
      {"kv-cache-capacity",
       [](Server& s) { return std::to_string(s.kv_cache() ? s.kv_cache()->capacity() : 0); },
       [](Server& s, std::string_view v, bool apply) {
         return SetInt(v, 1, int64_t{1} << 32, apply, [&](int64_t n) {
           if (s.kv_cache() != nullptr) s.kv_cache()->set_capacity(static_cast<uint64_t>(n));
         });
       }},
      {"compute-threads",
       [](Server& s) { return std::to_string(s.compute() ? s.compute()->threads() : 0); }, nullptr},
      {"compute-queue-depth",
       [](Server& s) { return std::to_string(s.compute() ? s.compute()->capacity() : 0); },
       nullptr},
      {"maxmemory", [](Server& s) { return std::to_string(s.memory().maxmemory()); },
       [](Server& s, std::string_view v, bool apply) {
         return SetSize(v, apply, [&](uint64_t n) { s.memory().set_maxmemory(n); });
       }},
      {"requirepass", [](Server& s) { return s.settings().requirepass(); },
       [](Server& s, std::string_view v, bool apply) {
         if (!apply) return std::string();
         s.settings().set_requirepass(std::string(v));
         s.users().SetDefaultPassword(std::string(v));
         s.settings().auth_required.store(!v.empty() || !s.config().users_file.empty());
         return std::string();
       }},
      {"proto-max-bulk-len",
       [](Server& s) { return std::to_string(s.settings().proto_max_bulk_len.load()); },
       [](Server& s, std::string_view v, bool apply) {
         return SetSize(v, apply, [&](uint64_t n) { s.settings().proto_max_bulk_len.store(n); });
       }},
      {"max-multibulk-len",
       [](Server& s) { return std::to_string(s.settings().max_multibulk_len.load()); },
       [](Server& s, std::string_view v, bool apply) {
         return SetInt(v, 1, int64_t{1} << 31, apply,
                       [&](int64_t n) { s.settings().max_multibulk_len.store(n); });
       }},
      {"client-query-buffer-limit",
       [](Server& s) { return std::to_string(s.settings().client_query_buffer_limit.load()); },
       [](Server& s, std::string_view v, bool apply) {
         return SetSize(v, apply,
                        [&](uint64_t n) { s.settings().client_query_buffer_limit.store(n); });
       }},
      {"client-output-buffer-limit",
       [](Server& s) { return std::to_string(s.settings().client_output_buffer_limit.load()); },
       [](Server& s, std::string_view v, bool apply) {
         return SetSize(v, apply,
                        [&](uint64_t n) { s.settings().client_output_buffer_limit.store(n); });
       }},
      {"client-output-buffer-timeout-ms",
       [](Server& s) {
         return std::to_string(s.settings().client_output_buffer_timeout_ms.load());
       },
       [](Server& s, std::string_view v, bool apply) {
         return SetInt(v, 1, 86400000, apply,
                       [&](int64_t n) { s.settings().client_output_buffer_timeout_ms.store(n); });
       }},
      {"maxclients", [](Server& s) { return std::to_string(s.settings().maxclients.load()); },
       [](Server& s, std::string_view v, bool apply) {
         return SetInt(v, 1, 1000000, apply, [&](int64_t n) { s.settings().maxclients.store(n); });
       }},
      {"shard-queue-depth", [](Server& s) { return std::to_string(s.shard_queue_depth()); },
       [](Server& s, std::string_view v, bool apply) {
         return SetInt(v, 1, 1 << 20, apply, [&](int64_t n) {
           for (int i = 0; i < s.shard_count(); ++i) s.shard(i).set_queue_depth(n);
         });
       }},
      {"poll-us", [](Server& s) { return std::to_string(s.shard(0).poll_us()); },
       [](Server& s, std::string_view v, bool apply) {
         return SetInt(v, 0, 1000000, apply, [&](int64_t n) {
           for (int i = 0; i < s.shard_count(); ++i) s.shard(i).set_poll_us(n);
         });
       }},
      {"slowlog-log-slower-than",
       [](Server& s) { return std::to_string(s.settings().slowlog_log_slower_than_us.load()); },
       [](Server& s, std::string_view v, bool apply) {
         return SetInt(v, -1, INT64_MAX, apply,
                       [&](int64_t n) { s.settings().slowlog_log_slower_than_us.store(n); });
       }},
      {"slowlog-max-len",
       [](Server& s) { return std::to_string(s.settings().slowlog_max_len.load()); },
       [](Server& s, std::string_view v, bool apply) {
         return SetInt(v, 0, 1 << 20, apply,
                       [&](int64_t n) { s.settings().slowlog_max_len.store(n); });
       }},
      {"loglevel", [](Server&) { return CurrentLogLevel(); },
       [](Server&, std::string_view v, bool apply) {
         for (const char* l : kLogLevels) {
           if (EqualsIgnoreCase(v, l)) {
             if (apply) spdlog::set_level(spdlog::level::from_str(l));
             return std::string();
           }
         }
         return std::string("argument must be one of trace, debug, info, warn, error");
       }},
  };
  return kParams;
}

void Config(CommandContext& ctx, CmdArgs& args) {
  auto& rb = *ctx.rb;
  auto& srv = *ctx.server;
  std::string_view sub = args[1];
  if (EqualsIgnoreCase(sub, "GET") && args.size() >= 3) {
    std::vector<const Param*> hits;
    for (const auto& p : Params()) {
      for (size_t i = 2; i < args.size(); ++i) {
        if (GlobMatch(args[i], p.name)) {
          hits.push_back(&p);
          break;
        }
      }
    }
    rb.Map(hits.size());
    for (const Param* p : hits) {
      rb.Bulk(p->name);
      rb.Bulk(p->get(srv));
    }
  } else if (EqualsIgnoreCase(sub, "SET") && args.size() >= 4 && args.size() % 2 == 0) {
    // Validate every pair first, so a failing pair leaves all settings unchanged.
    std::vector<std::pair<const Param*, std::string_view>> todo;
    for (size_t i = 2; i + 1 < args.size(); i += 2) {
      const Param* found = nullptr;
      for (const auto& p : Params()) {
        if (EqualsIgnoreCase(args[i], p.name)) found = &p;
      }
      if (found == nullptr) {
        rb.ErrorLine("ERR Unknown option or number of arguments for CONFIG SET - '" +
                     std::string(args[i].substr(0, 64)) + "'");
        return;
      }
      if (!found->set) {
        rb.ErrorLine("ERR CONFIG SET failed (possibly related to argument '" +
                     std::string(found->name) + "') - can't set immutable config");
        return;
      }
      std::string err = found->set(srv, args[i + 1], /*apply=*/false);
      if (!err.empty()) {
        rb.ErrorLine("ERR CONFIG SET failed (possibly related to argument '" +
                     std::string(found->name) + "') - " + err);
        return;
      }
      todo.emplace_back(found, args[i + 1]);
    }
    for (auto& [p, v] : todo) {
      std::string before = p->get(srv);
      (void)p->set(srv, v, /*apply=*/true);
      spdlog::info("CONFIG SET {}: {} -> {}", p->name,
                   std::string(p->name) == "requirepass" ? "***" : before,
                   std::string(p->name) == "requirepass" ? "***" : p->get(srv));
    }
    rb.Ok();
  } else if (EqualsIgnoreCase(sub, "RESETSTAT") && args.size() == 2) {
    srv.slowlog().Reset();
    rb.Ok();
  } else if (EqualsIgnoreCase(sub, "HELP")) {
    static const char* kHelp[] = {"CONFIG <subcommand> [<arg> ...]. Subcommands are:",
                                  "GET <pattern> [<pattern> ...]",
                                  "    Return parameters matching the glob-like patterns.",
                                  "SET <parameter> <value> [<parameter> <value> ...]",
                                  "    Set parameters (those changeable at run time).",
                                  "RESETSTAT",
                                  "    Reset the slow log.",
                                  "HELP",
                                  "    Print this help."};
    rb.Array(std::size(kHelp));
    for (const char* l : kHelp) rb.SimpleString(l);
  } else if (EqualsIgnoreCase(sub, "GET") || EqualsIgnoreCase(sub, "SET")) {
    rb.ErrorLine(
        server::ArityError("config|" + std::string(EqualsIgnoreCase(sub, "GET") ? "get" : "set")));
  } else {
    rb.ErrorLine(server::UnknownSubcommandError(sub, "config"));
  }
}

}  // namespace

void RegisterConfigFamily(server::Server& srv) {
  using namespace server;
  srv.registry().Register({"CONFIG", -2, kCmdAdmin, 0, 0, 0, Config, "server",
                           "Reads and changes server settings.",
                           "GET pattern [pattern ...]|SET parameter value [...]|RESETSTAT|HELP"});
}

}  // namespace pion::families
