// libFuzzer target for the command layer: argument vectors over every command of COMMAND LIST,
// run in process against the real server.
//
// LLVMFuzzerInitialize starts a whole pion-server in this process (two shards, CPU attention,
// a temporary --dir, 64 MiB --maxmemory, a 256 MiB disk quota, a Unix socket, a users file of
// three tenants). Each input is decoded into a handful of commands that a client sends over one
// or two connections (TCP or the Unix socket, RESP2 or RESP3, each command waiting for its
// reply or all pipelined, the two connections' interleaved), so every command takes the path
// a parsed RESP command takes: Connection → RespParser → Server::Dispatch
// (auth, arity, routing to the owning shard, parking on residency, compute jobs) → reply. Every
// reply must arrive within 10 s (a parked command that never completes is a hang) and be
// well-formed RESP; an error reply must start with an upper-case kind.
//
// State stays bounded and each input starts from an empty server: afterwards a second
// connection drops, with its family's DROP, every key a write command of the input named, in
// every tenant the input used; settings CONFIG SET changed are put back; and every family's
// charged host memory must then return to zero (a charge that outlives its object is a
// finding).
//
// Input: byte 0 = connection flags (bits 0-1 user: default, alice, carol, none; bit 2 HELLO 3;
// bit 3 pipelined; bit 4 TCP instead of the Unix socket). Then commands, each: one byte
// choosing the command (c < 0xF0: table[c % n]; else a length byte and the name itself), one
// byte for the argument count (bits 0-3) and the connection that sends it (bit 7: the input's
// second connection, of the same user), then per argument a tag byte and its payload (see
// NextArg). The key argument (the command's first_key) is always one byte choosing from
// kKeys, so whatever the input creates the cleanup can drop.
//
// Excluded from the table, by design: SHUTDOWN (stops the server the fuzzer runs in). Nothing
// else is excluded: QUIT, CLIENT KILL, a protocol error and CONFIG SET of connection limits
// may close a connection, which then takes no more commands; no command writes outside --dir
// (the server has no DEBUG SLEEP, and DEBUG.FAULT exists only in pion-server-faults).
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "families/families.h"
#include "resp_client.h"
#include "server/server.h"

namespace {

using pion::fuzz::Reply;
using pion::fuzz::RespClient;
using pion::server::CommandSpec;
using pion::server::MemFamily;

constexpr int kReplyTimeoutMs = 10000;
constexpr size_t kMaxCommands = 24;
constexpr size_t kBlobBudget = 512 << 10;  // generated blob bytes per input
constexpr size_t kMaxBlob = 256 << 10;

struct User {
  const char* name;
  const char* password;
  uint32_t tenant;
};
// default (tenant 0, --requirepass), and two users of other tenants (--users).
constexpr User kUsers[] = {{"default", "pw0", 0}, {"alice", "pw1", 1}, {"carol", "pw2", 2}};

// The names a key argument may take: plain, hash-tagged (co-located), a K/V session pair of a
// namespace, and awkward ones (empty, lone brace, CR LF, a path, too long for a file name once
// hex-encoded, binary).
const std::vector<std::string> kKeys = {"a",
                                        "b",
                                        "{t}a",
                                        "{t}b",
                                        "t",
                                        "a_pk",
                                        "a_pv",
                                        "",
                                        "{",
                                        "x\r\ny",
                                        "../../escape",
                                        "{}c",
                                        std::string(200, 'k'),
                                        std::string("\xff\x00z", 3)};

// Tokens an argument may take: numbers around every boundary the families check, keywords
// and subcommands of every command, codecs, users, settings and INFO sections.
const std::vector<std::string> kTokens = {
    // numbers
    "0", "1", "2", "3", "4", "7", "8", "16", "31", "32", "63", "64", "65", "127", "128", "256",
    "1000", "1024", "4096", "65536", "1048576", "-1", "-2", "2147483647", "2147483648",
    "4294967295", "4294967296", "9223372036854775807", "-9223372036854775808",
    "18446744073709551615", "99999999999999999999", "0.5", "0.95", "1.5", "-0.0", "1e308", "nan",
    "inf", "-inf", "", " 1", "1 ", "+1", "0x10", "1kb", "1mb", "64mb", "1gb", "00", "1.",
    // admission and query options
    "DEADLINE", "ALLOW", "APPROX", "RECEIPT", "QPOS", "SELECT", "mean", "quest", "SHARED", "PACKED",
    "FROM", "MODEL", "POSITION", "GENERATION", "PREFILL_MS", "m1", "m2", "d1",
    // V.* and KV.*
    "RAW", "SHM", "RANGE", "IDS", "BLOCK", "CRC32", "TTL", "THRESHOLD", "ALL", "EXPIRED", "fp32",
    "fp16", "bf16", "int8", "fp8", "turbo4", "turbo3", "turbo2", "FP16", "q8",
    // ATTEND.*
    "M", "EF", "EF_CONSTRUCTION", "METRIC", "ip", "l2", "cos", "ATTEND",
    // connection and server
    "GET", "SET", "LIST", "COUNT", "INFO", "DOCS", "HELP", "ID", "SETNAME", "GETNAME", "KILL",
    "ADDR", "LADDR", "USER", "SKIPME", "yes", "no", "LEN", "RESET", "RESETSTAT", "AUTH", "2", "3",
    "default", "alice", "carol", "pw0", "pw1", "pw2", "wrong", "127.0.0.1:1", "*",
    // CONFIG parameters (every one the table has, mutable or not)
    "maxmemory", "requirepass", "proto-max-bulk-len", "max-multibulk-len",
    "client-query-buffer-limit", "client-output-buffer-limit", "client-output-buffer-timeout-ms",
    "maxclients", "shard-queue-depth", "poll-us", "slowlog-log-slower-than", "slowlog-max-len",
    "loglevel", "attention-memory", "kv-cache-capacity", "gpu-memory", "dir", "workers", "warn",
    "debug",
    // INFO sections
    "server", "clients", "memory", "persistence", "stats", "commandstats", "keyspace", "attention",
    "residency", "everything",
    // commands as arguments (COMMAND INFO/DOCS)
    "ping", "state.alloc", "attend.prefix.query", "nosuch"};

// A run of the server in this process.
struct Harness {
  std::string root;  // temporary directory: data, socket, users file
  std::string sock;
  std::unique_ptr<pion::server::Server> server;
  std::thread runner;
  std::vector<const CommandSpec*> table;
  pion::server::Config config;
  RespClient admin;    // the cleanup connection (default user)
  bool trace = false;  // COMMAND_FUZZ_TRACE=1: print each command and its reply
};
Harness* g = nullptr;

void Die(const std::string& what) {
  std::fprintf(stderr, "command_fuzz: %s\n", what.c_str());
  std::abort();
}

void Stop() {
  if (g == nullptr) return;
  g->admin.Close();
  g->server->RequestShutdown();
  g->runner.join();
  g->server.reset();
  std::error_code ec;
  std::filesystem::remove_all(g->root, ec);
  delete g;
  g = nullptr;
}

// Sends args on c and reads the reply into *r; false if the connection closes first.
bool TryCall(RespClient& c, const std::vector<std::string>& args, Reply* r) {
  c.Append(args);
  c.Flush(kReplyTimeoutMs);
  return c.Read(r, kReplyTimeoutMs, args[0]) == 1;
}

// Sends args on c and returns the reply; aborts if the connection closes first.
Reply Call(RespClient& c, const std::vector<std::string>& args) {
  c.Append(args);
  if (!c.Flush(kReplyTimeoutMs)) Die("connection closed sending " + args[0]);
  Reply r;
  if (c.Read(&r, kReplyTimeoutMs, args[0]) != 1)
    Die("connection closed before the reply to " + args[0]);
  return r;
}

void ConnectAdmin() {
  if (!g->admin.Connect(g->sock, 0)) Die("cannot connect the cleanup connection");
  Reply r = Call(g->admin, {"AUTH", "default", "pw0"});
  if (r.error()) Die("cleanup AUTH failed: " + r.text);
}

// Puts back every setting CONFIG SET may have changed.
void RestoreSettings() {
  auto& s = *g->server;
  const auto& c = g->config;
  auto& st = s.settings();
  st.proto_max_bulk_len.store(c.proto_max_bulk_len);
  st.max_multibulk_len.store(c.max_multibulk_len);
  st.client_query_buffer_limit.store(c.client_query_buffer_limit);
  st.client_output_buffer_limit.store(c.client_output_buffer_limit);
  st.client_output_buffer_timeout_ms.store(c.client_output_buffer_timeout_ms);
  st.maxclients.store(c.maxclients);
  st.slowlog_log_slower_than_us.store(c.slowlog_log_slower_than_us);
  st.slowlog_max_len.store(c.slowlog_max_len);
  st.set_requirepass(c.requirepass);
  s.users().SetDefaultPassword(c.requirepass);
  st.auth_required.store(true);
  s.memory().set_maxmemory(c.maxmemory);
  s.memory().set_family_limit(MemFamily::kAttention, c.attention_memory);
  if (s.kv_cache() != nullptr) s.kv_cache()->set_capacity(c.kv_cache_capacity);
  for (int i = 0; i < s.shard_count(); ++i) {
    s.shard(i).set_queue_depth(static_cast<size_t>(c.shard_queue_depth));
    s.shard(i).set_poll_us(0);
  }
  spdlog::set_level(spdlog::level::err);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g = new Harness;
  const char* base = std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp";
  char tmpl[64];
  std::snprintf(tmpl, sizeof(tmpl), "%s/pion-command-fuzz.XXXXXX", base);
  if (mkdtemp(tmpl) == nullptr) Die("mkdtemp failed");
  g->root = tmpl;
  g->sock = g->root + "/pion.sock";
  {
    std::ofstream users(g->root + "/users.txt");
    users << "alice pw1 t1\ncarol pw2 t2\n";
  }
  auto logger = spdlog::stderr_color_mt("pion");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::err);

  pion::server::Config& c = g->config;
  c.bind = "127.0.0.1";
  c.port = 0;
  c.binary_port = 0;
  c.metrics_port = 0;
  c.unixsocket = g->sock;
  c.shm_segment_size = 8 << 20;
  c.workers = 2;
  c.dir = g->root + "/data";
  c.maxmemory = 64 << 20;
  c.maxmemory_auto = false;
  c.disk_quota = 256 << 20;
  c.disk_quota_auto = false;
  c.promotion_credits = 64 << 20;
  c.requirepass = "pw0";
  c.users_file = g->root + "/users.txt";
  c.client_query_buffer_limit = 64 << 20;
  c.io_threads = 1;
  c.compute_threads = 1;
  c.compute_queue_depth = 16;
  c.attention_backend = "cpu";
  c.kv_cache_capacity = 64;
  c.poll_us = 0;
  c.loglevel = "error";
  g->server = std::make_unique<pion::server::Server>(c);
  pion::families::RegisterAll(*g->server);
  pion::Status s = g->server->Init();
  if (!s.ok()) Die("server Init: " + s.message());
  for (const auto& spec : g->server->registry().all()) {
    if (spec.name == "SHUTDOWN") continue;  // stops the server (see the header comment)
    g->table.push_back(&spec);
  }
  g->trace = std::getenv("COMMAND_FUZZ_TRACE") != nullptr;
  g->runner = std::thread([] { g->server->Run(); });
  ConnectAdmin();
  std::atexit(Stop);  // a clean shutdown, then LeakSanitizer's check at exit
  return 0;
}

namespace {

// Reads the input; past its end every byte reads 0.
struct Input {
  const uint8_t* p;
  size_t n;
  size_t off = 0;
  bool done() const { return off >= n; }
  uint8_t Byte() { return off < n ? p[off++] : 0; }
  uint16_t U16() { return static_cast<uint16_t>(Byte() | (Byte() << 8)); }
  std::string Bytes(size_t len) {
    len = std::min(len, n - std::min(off, n));
    std::string s(reinterpret_cast<const char*>(p + off), len);
    off += len;
    return s;
  }
};

// Deterministic blob contents from a seed byte: fp32 in [-2, 2) (seed 0: zeros; 0xFF: NaN,
// infinities, signed zero and denormals among them), fp16 halves, or small int32 / int64
// values in [0, (seed & 63) + 1) with negatives and large values when seed & 0x80.
std::string Blob(size_t bytes, int kind, uint8_t seed) {
  std::string b(bytes, '\0');
  uint32_t x = 0x9E3779B9u ^ (seed * 0x01000193u);
  auto next = [&] {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return x;
  };
  auto put = [&](size_t at, const void* v, size_t w) {
    if (at + w <= b.size()) std::memcpy(b.data() + at, v, w);
  };
  if (seed == 0 && kind == 0) return b;
  for (size_t at = 0; at < bytes;) {
    const uint32_t r = next();
    if (kind == 0) {  // fp32
      float f = static_cast<float>(r >> 8) / 16777216.0f * 4.0f - 2.0f;
      if (seed == 0xFF && r % 7 == 0) {
        const float special[] = {
            __builtin_nanf(""), __builtin_inff(), -__builtin_inff(), -0.0f, 1e-40f, 3e38f};
        f = special[r % 6];
      }
      put(at, &f, 4);
      at += 4;
    } else if (kind == 1) {  // fp16 bits
      const uint16_t h = static_cast<uint16_t>(r);
      put(at, &h, 2);
      at += 2;
    } else {  // int32 / int64
      int64_t v = static_cast<int64_t>(r % ((seed & 63u) + 1));
      if ((seed & 0x80) && r % 5 == 0) v = (r & 1) ? -1 - v : (int64_t{1} << 31) + v;
      if (kind == 2) {
        const int32_t v32 = static_cast<int32_t>(v);
        put(at, &v32, 4);
        at += 4;
      } else {
        put(at, &v, 8);
        at += 8;
      }
    }
  }
  return b;
}

struct Decoder {
  Input in;
  size_t blob_bytes = 0;
  std::vector<std::string> recent;  // scalars of earlier replies (ids, leases, snapshots)
  // What the input may have created: (the drop command of its family, kKeys index).
  std::set<std::pair<std::string, size_t>> created;
};

// The command that drops what a write command of this family stores under its key.
const char* DropFor(const std::string& name) {
  for (const auto& [prefix, drop] : std::initializer_list<std::pair<std::string, const char*>>{
           {"ATTEND.PREFIX.", "ATTEND.PREFIX.DROP"},
           {"ATTEND.", "ATTEND.DROP"},
           {"KV.PREFIX.", "KV.PREFIX.DROP"},  // and its <ns>_pk/_pv sessions
           {"SSM.PREFIX.", "SSM.PREFIX.DROP"},
           {"STATE.", "STATE.FREE"},
           {"V.", "V.DROP"}}) {
    if (name.rfind(prefix, 0) == 0) return drop;
  }
  return nullptr;
}

// One argument. `ints` are the integers among this command's earlier arguments, most recent
// last, for blobs whose size follows from them.
std::string NextArg(Decoder& d, std::vector<int64_t>& ints) {
  const uint8_t tag = d.in.Byte();
  std::string a;
  switch (tag % 8) {
    case 0:
    case 1:
    case 2:
      a = kTokens[d.in.Byte() % kTokens.size()];
      break;
    case 3: {  // an integer: small ones, and ones near powers of two
      const uint8_t v = d.in.Byte();
      if (v < 128) {
        a = std::to_string(static_cast<int>(v) - 4);
      } else {
        const int sh = (v - 128) % 64;
        const int64_t p = sh == 63 ? INT64_MAX : int64_t{1} << sh;
        a = std::to_string((v & 64) ? p - 1 : p);
      }
      break;
    }
    case 4: {  // raw bytes from the input
      a = d.in.Bytes(d.in.Byte());
      break;
    }
    case 5: {  // an fp32 blob of an exact byte length
      size_t len = std::min<size_t>(d.in.U16(), kMaxBlob);
      const uint8_t seed = d.in.Byte();
      if (d.blob_bytes + len > kBlobBudget) len = 0;
      d.blob_bytes += len;
      a = Blob(len, 0, seed);
      break;
    }
    case 6: {  // a blob shaped by this command's integers: their product times a width
      const uint8_t mask = d.in.Byte();
      const uint8_t kind = d.in.Byte();
      const uint8_t seed = d.in.Byte();
      const int width[] = {4, 2, 4, 8};
      uint64_t n = static_cast<uint64_t>(width[kind % 4]) * (1 + ((kind >> 2) & 3));
      for (size_t i = 0; i < 6 && i < ints.size(); ++i) {
        if (!(mask & (1u << i))) continue;
        const int64_t v = ints[ints.size() - 1 - i];
        n = (v <= 0 || v > int64_t{1} << 24) ? kMaxBlob + 1 : n * static_cast<uint64_t>(v);
        if (n > kMaxBlob) break;
      }
      if (n > kMaxBlob || d.blob_bytes + n > kBlobBudget) n = 4;
      d.blob_bytes += n;
      a = Blob(n, kind % 4 == 0 ? 0 : kind % 4 == 1 ? 1 : kind % 4 == 2 ? 2 : 3, seed);
      break;
    }
    default: {  // a key name, or a scalar from an earlier reply
      const uint8_t v = d.in.Byte();
      if ((v & 1) && !d.recent.empty()) {
        a = d.recent[d.recent.size() - 1 - (v >> 1) % d.recent.size()];  // 0: the latest
      } else {
        a = kKeys[(v >> 1) % kKeys.size()];  // a name referred to (FROM <ns>), not created
      }
      break;
    }
  }
  char* end = nullptr;
  const long long v = a.empty() ? 0 : std::strtoll(a.c_str(), &end, 10);
  if (!a.empty() && end != nullptr && *end == '\0') ints.push_back(v);
  return a;
}

struct Command {
  std::vector<std::string> args;
  const CommandSpec* spec = nullptr;
  int conn = 0;  // which of the input's two connections sends it
};

bool NextCommand(Decoder& d, Command* cmd) {
  if (d.in.done()) return false;
  const uint8_t c = d.in.Byte();
  if (c < 0xF0) {
    cmd->spec = g->table[c % g->table.size()];
    cmd->args = {cmd->spec->name};
  } else {
    std::string name = d.in.Bytes(d.in.Byte());
    if (name.empty()) name = "PING";
    cmd->spec = g->server->registry().Find(name);
    if (cmd->spec != nullptr && cmd->spec->name == "SHUTDOWN") name = "PING";
    cmd->spec = g->server->registry().Find(name);
    cmd->args = {name};
  }
  const uint8_t argc = d.in.Byte();
  const size_t nargs = argc % 16;
  cmd->conn = argc >> 7;
  std::vector<int64_t> ints;
  for (size_t i = 1; i <= nargs; ++i) {
    if (cmd->spec != nullptr && cmd->spec->first_key == static_cast<int>(i)) {
      const size_t k = d.in.Byte() % kKeys.size();
      const char* drop = DropFor(cmd->spec->name);
      if ((cmd->spec->flags & pion::server::kCmdWrite) && drop != nullptr) {
        d.created.insert({drop, k});
      }
      cmd->args.push_back(kKeys[k]);
    } else {
      cmd->args.push_back(NextArg(d, ints));
    }
  }
  return true;
}

void Remember(Decoder& d, const Reply& r, int budget = 4) {
  if (r.type == ':') {
    d.recent.push_back(std::to_string(r.integer));
  } else if ((r.type == '$' || r.type == '+') && !r.null && r.text.size() <= 64) {
    d.recent.push_back(r.text);
  }
  for (const Reply& e : r.elems) {
    if (budget-- <= 0) break;
    Remember(d, e, 0);
  }
  if (d.recent.size() > 16) d.recent.erase(d.recent.begin(), d.recent.end() - 16);
}

// Commands after which the server may close the connection by design: QUIT, CLIENT KILL, and
// CONFIG SET of a limit the connection then exceeds.
bool MayClose(const Command& cmd) {
  if (cmd.spec == nullptr) return false;
  const std::string& n = cmd.spec->name;
  return n == "QUIT" || n == "CLIENT" || n == "CONFIG";
}

std::string Summary(const Reply& r) {
  std::string s(1, r.type);
  if (r.null) return s + "null";
  if (r.type == ':') return s + std::to_string(r.integer);
  if (!r.elems.empty() || r.type == '*' || r.type == '%' || r.type == '~') {
    s += "[" + std::to_string(r.elems.size()) + "]";
    for (size_t i = 0; i < r.elems.size() && i < 4; ++i) s += " " + Summary(r.elems[i]);
    return s;
  }
  return s + RespClient::Escape(r.text.substr(0, 100)) +
         (r.text.size() > 100 ? "...(" + std::to_string(r.text.size()) + ")" : "");
}

void Trace(const Command& cmd, const Reply& r) {
  std::string line = ">";
  for (const auto& a : cmd.args) {
    line +=
        " " + (a.size() > 40 ? "<" + std::to_string(a.size()) + " bytes>" : RespClient::Escape(a));
  }
  std::fprintf(stderr, "%s\n< %s\n", line.c_str(), Summary(r).c_str());
}

// An error reply names its kind first: upper-case letters, then a space or the end.
void CheckError(const Reply& r, const Command& cmd) {
  const std::string& t = r.text;
  size_t i = 0;
  while (i < t.size() && t[i] >= 'A' && t[i] <= 'Z') ++i;
  if (i == 0 || (i < t.size() && t[i] != ' ')) {
    Die("error reply to " + cmd.args[0] +
        " without an upper-case kind: " + RespClient::Escape(t.substr(0, 120)));
  }
}

// Drops what the input may have created, in every tenant it used, then waits for every
// family's host charge to return to zero.
void Cleanup(const std::set<uint32_t>& tenants,
             const std::set<std::pair<std::string, size_t>>& created, bool kv_cache) {
  std::vector<std::vector<std::string>> cmds;
  for (uint32_t t : tenants) {
    cmds.push_back({"AUTH", kUsers[t].name, kUsers[t].password});
    for (const auto& [drop, k] : created) cmds.push_back({drop, kKeys[k]});
    if (kv_cache) cmds.push_back({"KV.EVICT", "ALL"});
  }
  cmds.push_back({"AUTH", "default", "pw0"});
  // CLIENT KILL may have closed the cleanup connection too: then reconnect and run it all
  // again (every drop is idempotent). -BUSY (a full shard inbox) is retried.
  for (int attempt = 0;; ++attempt) {
    if (attempt > 100) Die("cleanup did not complete after 100 attempts");
    for (const auto& c : cmds) g->admin.Append(c);
    bool closed = !g->admin.Flush(kReplyTimeoutMs), busy = false;
    for (size_t i = 0; i < cmds.size() && !closed; ++i) {
      Reply r;
      if (g->admin.Read(&r, kReplyTimeoutMs, "cleanup " + cmds[i][0]) != 1) {
        closed = true;
      } else if (r.error()) {
        if (r.text.rfind("BUSY", 0) != 0) {
          Die("cleanup " + cmds[i][0] + " " + RespClient::Escape(cmds[i][1]) +
              " failed: " + r.text);
        }
        busy = true;
      }
    }
    if (!closed && !busy) break;
    if (closed) ConnectAdmin();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  auto& mem = g->server->memory();
  for (int i = 0; mem.used() != 0; ++i) {
    if (i == 2000) {
      std::string by;
      for (int f = 0; f < static_cast<int>(MemFamily::kCount); ++f) {
        by += std::string(" ") +
              std::string(pion::server::MemFamilyName(static_cast<MemFamily>(f))) + "=" +
              std::to_string(mem.used(static_cast<MemFamily>(f)));
      }
      Die("host memory still charged after dropping everything the input created:" + by);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  Decoder d{Input{data, size}};
  const uint8_t flags = d.in.Byte();
  const int user = flags & 3;
  const bool resp3 = flags & 4, pipelined = flags & 8, tcp = flags & 16;

  // Two connections of the same user, opened when a command first needs them; one that the
  // server closed by design takes no more commands.
  struct Conn {
    RespClient c;
    bool open = false, gone = false;
    std::vector<const Command*> pending;  // pipelined: sent, reply not read yet
  };
  Conn conns[2];
  std::set<uint32_t> tenants = {0};
  if (user < 3) tenants.insert(kUsers[user].tenant);
  bool may_close = false, kv_cache = false, config = false;
  auto open = [&](Conn& k) {
    k.open = true;
    std::string why;
    Reply r;
    if (!k.c.Connect(tcp ? std::string() : g->sock, g->server->port())) {
      why = std::string(tcp ? "TCP" : "Unix socket") + " connect failed: " + k.c.LastError();
    }
    if (why.empty() && user < 3) {
      if (!TryCall(k.c, {"AUTH", kUsers[user].name, kUsers[user].password}, &r)) {
        why = "closed before AUTH";
      } else if (r.error()) {
        why = "AUTH " + std::string(kUsers[user].name) + ": " + r.text;
      }
    }
    if (why.empty() && resp3) {
      if (!TryCall(k.c, {"HELLO", "3"}, &r)) {
        why = "closed before HELLO 3";
      } else if (r.error() != (user == 3)) {  // refused (NOAUTH) without a user
        why = "HELLO 3: " + Summary(r);
      }
    }
    if (why.empty()) return;
    // CONFIG SET requirepass or maxclients earlier in the input may refuse a new connection,
    // and a CLIENT KILL still in flight on the other connection may close it.
    if (!config && !may_close) Die("opening a connection: " + why);
    k.gone = true;
    k.c.Close();
  };

  auto note = [&](const Command& cmd) {
    may_close |= MayClose(cmd);
    if (cmd.spec != nullptr && cmd.spec->name == "KV.STORE") kv_cache = true;
    if (cmd.spec != nullptr && cmd.spec->name == "CONFIG") config = true;
    // AUTH/HELLO may switch to any user's tenant.
    if (cmd.spec != nullptr && (cmd.spec->name == "AUTH" || cmd.spec->name == "HELLO")) {
      for (const auto& u : kUsers) tenants.insert(u.tenant);
    }
  };
  // Reads the reply to cmd on k; false when the server closed the connection first.
  auto read = [&](Conn& k, const Command& cmd) {
    Reply r;
    if (k.c.Read(&r, kReplyTimeoutMs, cmd.args[0]) != 1) {
      if (!may_close) Die("server closed the connection before replying to " + cmd.args[0]);
      k.gone = true;
      return false;
    }
    if (g->trace) Trace(cmd, r);
    if (r.error()) CheckError(r, cmd);
    // A protocol error (an argument past a limit) is the last reply before the server closes.
    if (r.error() && r.text.rfind("ERR Protocol error", 0) == 0) may_close = true;
    Remember(d, r);
    return true;
  };

  std::vector<Command> cmds;
  cmds.reserve(kMaxCommands);
  Command cmd;
  while (cmds.size() < kMaxCommands && NextCommand(d, &cmd)) {
    cmds.push_back(std::move(cmd));
    const Command& c = cmds.back();
    Conn& k = conns[c.conn];
    if (!k.open && !k.gone) open(k);
    if (k.gone) continue;
    note(c);
    k.c.Append(c.args);
    k.c.Flush(kReplyTimeoutMs);  // on a closed connection the replies sent before still count
    if (pipelined) {
      k.pending.push_back(&c);  // read at the end: the two connections' commands interleave
    } else {
      read(k, c);
    }
  }
  for (Conn& k : conns) {
    for (const Command* c : k.pending) {
      if (!read(k, *c)) break;
    }
    k.c.Close();
  }
  if (config) RestoreSettings();
  Cleanup(tenants, d.created, kv_cache);
  return 0;
}
