// The command table: every family registers its commands (name, arity, flags, key position,
// handler) here, and the dispatcher uses it for lookup, arity checks, auth, routing to the
// owning shard, COMMAND/COMMAND DOCS, and per-command statistics.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "proto/cmd_args.h"
#include "proto/reply_builder.h"
#include "residency/object.h"
#include "residency/tier.h"
#include "store/tenant_key.h"

namespace pion::net {
class Connection;
}

namespace pion::server {

class Server;
class Shard;

enum CommandFlag : uint32_t {
  kCmdWrite = 1u << 0,       // stores or deletes data
  kCmdReadOnly = 1u << 1,    // only reads data
  kCmdAdmin = 1u << 2,       // server administration (CONFIG, SHUTDOWN, ...)
  kCmdNoAuth = 1u << 3,      // accepted before AUTH (AUTH, HELLO, PING, QUIT)
  kCmdFast = 1u << 4,        // O(1), never blocks
  kCmdConnection = 1u << 5,  // runs on the connection's shard with access to the Connection
  kCmdKvCache = 1u << 6,     // part of the K/V cache families, gated by --kvcache
  kCmdDenyOom = 1u << 7,     // may allocate; subject to --maxmemory
  kCmdDeadline = 1u << 8,    // takes trailing DEADLINE <ms> (or --default-deadline-ms)
  kCmdApprox = 1u << 9,      // takes trailing ALLOW APPROX (a declared approximate fallback)
};

struct CommandSpec;

// What a handler gets. Runs on `shard`, which owns the command's key (or is the connection's
// shard for keyless commands).
struct CommandContext {
  Server* server;
  Shard* shard;
  proto::ReplyBuilder* rb;
  uint32_t tenant;
  uint64_t client_id;
  net::Connection* conn;     // non-null only for kCmdConnection commands
  int origin_shard = 0;      // the shard of the client's connection
  int resp = 2;              // the client's protocol version
  bool unix_socket = false;  // the client is on --unixsocket (same host): it may get mappings
  bool deferred = false;     // set by Defer()
  // Set by the dispatcher:
  const CommandSpec* spec = nullptr;
  proto::CmdArgs* args = nullptr;
  // When the request must be answered by (DEADLINE <ms>, --default-deadline-ms), for
  // kCmdDeadline commands; kNoDeadline otherwise.
  residency::Deadline deadline = residency::kNoDeadline;
  bool allow_approx = false;  // ALLOW APPROX was given (kCmdApprox commands)
  int reruns = 0;             // how often this command was parked and run again
  // When the command started: a deferred reply records the command's latency and error in
  // the command stats when it is written (the dispatcher records the others on return).
  std::chrono::steady_clock::time_point start{};
  // Pins taken by Resident(): held until the handler returns, unless it takes them.
  residency::PinSet* pins = nullptr;

  // Writes an error reply and counts OOM/BUSY/TIMEOUT rejections in the shard's stats.
  void Error(const Status& status);
  // "wrong number of arguments" for this command, counted like the dispatcher's (for commands
  // whose trailing options make the dispatcher's arity check a minimum only).
  void WrongArity();

  // `name` scoped by the caller's tenant: how every family keys what it stores.
  store::TenantKey Key(std::string_view name) const { return {tenant, std::string(name)}; }

  // For handlers that finish later (disk I/O): the handler writes no reply now, and must
  // call the returned function exactly once, from any thread, with a writer of the reply.
  // The client's later pipelined commands wait, so replies keep their order.
  using ReplyWriter = std::function<void(proto::ReplyBuilder&)>;
  std::function<void(ReplyWriter)> Defer();

  // Residency (seed 004 §0x04B). True when every object is resident in `tier`: they are then
  // pinned there until the handler returns (or TakePins). Otherwise the command is parked —
  // the reply is deferred, the engine promotes them (one transfer per object however many
  // requests wait, under this request's deadline) — and the handler runs again on this shard
  // once they are in, with the same arguments; a failure (-TIMEOUT, -BUSY, -OOM tier=...,
  // -CORRUPT) becomes the reply. False then: the handler must return at once, having changed
  // nothing (so check residency before any side effect).
  bool Resident(const std::vector<residency::ObjectRef>& objs, residency::Tier tier);
  // The same for room: true when `bytes` fit in `tier` for `family` now; otherwise parks the
  // command while demotions make room, then runs it again.
  bool Room(residency::Tier tier, residency::Family family, uint64_t bytes);
  // The pins Resident() took, for work that outlives the handler (a compute job).
  residency::PinSet TakePins();
  // Parks the command until `wait` reports: done(Ok) runs the handler again on this shard, an
  // error becomes the reply. The handler must return at once.
  void ParkUntil(std::function<void(std::function<void(const Status&)>)> wait);

 private:
  using Wait = std::function<void(std::function<void(const Status&, residency::PinSet)>)>;
  void Park(Wait wait);
};

using CommandHandler = std::function<void(CommandContext&, proto::CmdArgs&)>;

// The refusal of a write while SHUTDOWN SAVE saves (Server::PauseWrites): kBusy.
Status WritesPausedError();

// A keyword option a command takes after its own arguments, in any order ("RECEIPT": 0
// values, "MODEL <id>": 1). The dispatcher uses them to find DEADLINE <ms> and ALLOW APPROX
// among a command's trailing options (kCmdDeadline / kCmdApprox), wherever they stand.
struct TrailingOption {
  std::string_view name;  // upper case
  int values = 0;
};

struct CommandSpec {
  std::string name;  // upper case, e.g. "STATE.ALLOC"
  int arity;         // Redis convention: N exact (incl. name), -N at least N
  uint32_t flags;
  int first_key = 0;  // argument index of the routing key; 0 = keyless
  int last_key = 0;
  int key_step = 0;
  CommandHandler handler;
  std::string group;    // "server", "connection", "state", ...
  std::string summary;  // one line, shown by COMMAND DOCS
  std::string syntax;   // argument grammar, e.g. "<id> <offset> <len>"
  size_t index = 0;     // assigned at registration; indexes per-command stats
  std::string lower_name;
  // Maps the key argument to the string that is hashed for routing (default: the key).
  // Lets a family co-locate related keys, e.g. "<ns>_pk" with "<ns>".
  std::string_view (*route_key)(std::string_view key) = nullptr;
  // Keys beyond first_key..last_key, at positions that depend on the arguments (ATTEND.PREFIX.
  // STORE ... FROM <ns>): cluster mode requires them in the routing key's slot (-CROSSSLOT).
  void (*more_keys)(const proto::CmdArgs& args, std::vector<std::string_view>* keys) = nullptr;
  // The command's own trailing keyword options (see TrailingOption).
  std::vector<TrailingOption> options;
};

// `spec` with its trailing keyword options, for registration.
inline CommandSpec WithOptions(CommandSpec spec, std::vector<TrailingOption> options) {
  spec.options = std::move(options);
  return spec;
}

// ", DEADLINE <ms>, ALLOW APPROX" (what of it the command takes) for the family's "unknown
// option" errors, so that they name every option the command accepts.
std::string AdmissionOptionsHint(const CommandSpec* spec);

class CommandRegistry {
 public:
  // Registers a command. Names are unique; a duplicate aborts start-up (programming error).
  void Register(CommandSpec spec);
  // Case-insensitive lookup; does not allocate. Returns nullptr if unknown.
  const CommandSpec* Find(std::string_view name) const;
  // The same, for a family that amends another family's command at registration (before Init).
  CommandSpec* FindMutable(std::string_view name) {
    return const_cast<CommandSpec*>(static_cast<const CommandRegistry*>(this)->Find(name));
  }
  const std::vector<CommandSpec>& all() const { return specs_; }
  size_t size() const { return specs_.size(); }

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
  };
  std::vector<CommandSpec> specs_;
  std::unordered_map<std::string, size_t, Hash, std::equal_to<>> by_name_;
};

// Redis-compatible error texts shared by the dispatcher and families.
std::string UnknownCommandError(const proto::CmdArgs& args);
std::string ArityError(std::string_view lower_name);
std::string UnknownSubcommandError(std::string_view sub, std::string_view lower_name);

}  // namespace pion::server
