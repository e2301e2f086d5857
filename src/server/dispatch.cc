// The command pipeline (Server::Dispatch / Server::Execute).
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <vector>

#include "cluster/key_slot.h"
#include "server/server.h"

namespace pion::server {
namespace {

bool ArityOk(const CommandSpec& spec, size_t n) {
  return spec.arity >= 0 ? n == static_cast<size_t>(spec.arity)
                         : n >= static_cast<size_t>(-spec.arity);
}

// One command forwarded to the shard that owns its key.
struct RemoteCall {
  const CommandSpec* spec;
  proto::CmdArgs args;
  proto::ReplyBuffer reply;
  uint32_t tenant;
  uint64_t client_id;
  int origin;
  int resp;
  std::string peer;
  std::string client_name;
  bool unix_socket = false;
  // Cluster mode: the key decides, on its shard, whether the command runs (ClusterRouting).
  bool check_key = false;
  int slot = -1;
  SlotRoute route;
};

// Takes the admission options of a kCmdDeadline / kCmdApprox command — DEADLINE <ms> and ALLOW
// APPROX — from among its trailing options, in any order: it scans back from the last argument
// over the keywords the command declares (CommandSpec::options) and these two, never into the
// arguments its arity asks for (a blob that happens to read "DEADLINE" is a blob). The
// command's own options stay, in their order.
// A word that can only be an option keyword (letters and '_', at most 32): looked past, so that
// an unknown option after DEADLINE is named by the command, not DEADLINE. No value of an option
// here, no id and no blob past a command's own arguments has that shape and is taken for one.
bool IsWord(std::string_view a) {
  if (a.empty() || a.size() > 32) return false;
  for (char c : a) {
    if (!std::isalpha(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

Status TakeAdmission(const CommandSpec& spec, proto::CmdArgs& args, int64_t* deadline_ms,
                     bool* approx) {
  const size_t positional = static_cast<size_t>(spec.arity < 0 ? -spec.arity : spec.arity);
  auto is = [](std::string_view a, std::string_view upper) {
    if (a.size() != upper.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (std::toupper(static_cast<unsigned char>(a[i])) != upper[i]) return false;
    }
    return true;
  };
  auto values_of = [&](std::string_view a) {
    for (const TrailingOption& o : spec.options) {
      if (is(a, o.name)) return o.values;
    }
    return -1;
  };
  const bool takes_deadline = spec.flags & kCmdDeadline, takes_approx = spec.flags & kCmdApprox;
  std::vector<size_t> taken;  // first argument of each pair to drop, last one first
  size_t end = args.size();
  while (end > positional) {
    const bool pair = end >= positional + 2;
    if (takes_deadline && pair && is(args[end - 2], "DEADLINE")) {
      std::string v(args[end - 1]);
      char* stop = nullptr;
      const long long ms = std::strtoll(v.c_str(), &stop, 10);
      if (v.empty() || *stop != '\0' || ms < 1 || ms > 86400000) {
        return Error("DEADLINE must be a whole number of milliseconds in [1, 86400000], got '" +
                     v.substr(0, 32) + "'");
      }
      *deadline_ms = ms;
      taken.push_back(end - 2);
      end -= 2;
    } else if (takes_approx && pair && is(args[end - 2], "ALLOW") && is(args[end - 1], "APPROX")) {
      *approx = true;
      taken.push_back(end - 2);
      end -= 2;
    } else if (pair && values_of(args[end - 2]) == 1) {
      end -= 2;
    } else if (end >= positional + 3 && values_of(args[end - 3]) == 2) {
      end -= 3;
    } else if (values_of(args[end - 1]) == 0 || IsWord(args[end - 1])) {
      end -= 1;  // an option without a value, or an unknown word the command will name
    } else {
      break;
    }
  }
  for (size_t i : taken) args.Erase(i, 2);  // from the back: earlier indexes stay valid
  return Status::Ok();
}

}  // namespace

void Server::Dispatch(Shard& shard, net::Connection& conn, proto::CmdArgs& args) {
  ShardStats& st = shard.stats();
  Bump(st.commands_processed);
  proto::ReplyBuilder& rb = conn.reply();
  const CommandSpec* spec = registry_.Find(args[0]);
  const bool auth_ok =
      conn.authenticated || !settings_.auth_required.load(std::memory_order_relaxed);

  if (spec == nullptr) {
    st.Reject(auth_ok ? RejectReason::kUnknownCommand : RejectReason::kNoAuth);
    rb.ErrorLine(auth_ok ? UnknownCommandError(args) : "NOAUTH Authentication required.");
    return;
  }
  conn.last_command = spec->lower_name;
  CommandStats& cs = st.commands[spec->index];
  if (!auth_ok && !(spec->flags & kCmdNoAuth)) {
    st.Reject(RejectReason::kNoAuth);
    Bump(cs.rejected);
    rb.ErrorLine("NOAUTH Authentication required.");
    return;
  }
  if (!ArityOk(*spec, args.size())) {
    st.Reject(RejectReason::kArity);
    Bump(cs.rejected);
    rb.ErrorLine(ArityError(spec->lower_name));
    return;
  }
  if ((spec->flags & kCmdAdmin) && conn.tenant != kDefaultTenant) {
    Bump(cs.rejected);
    rb.ErrorLine("NOPERM this user has no permissions to run the '" + spec->lower_name +
                 "' command (administrative commands need a user of tenant 'default')");
    return;
  }
  if ((spec->flags & kCmdKvCache) && !config_.kvcache) {
    st.Reject(RejectReason::kKvCacheDisabled);
    Bump(cs.rejected);
    rb.ErrorLine("ERR state cache not enabled (use --kvcache)");
    return;
  }

  const bool keyed = spec->first_key > 0 && args.size() > static_cast<size_t>(spec->first_key);
  // Cluster mode: the key's hash slot decides the node before anything runs.
  SlotRoute route;
  int slot = -1;
  if (cluster_ != nullptr) {
    const bool asking = conn.asking && spec->name != "ASKING";
    if (asking) conn.asking = false;
    std::string error;
    if (keyed && !ClusterCheck(*spec, args, asking, &slot, &route, &error)) {
      Bump(cs.rejected);
      rb.ErrorLine(error);
      return;
    }
  }
  const bool check_key = keyed && route.kind == SlotRoute::Kind::kCheckKey;

  // Commands route by their key when it is present (V.INFO <sid>); without it (or keyless)
  // they run on the connection's shard, which is also where kCmdConnection handlers get
  // the Connection.
  int owner = shard.id();
  if (keyed) {
    std::string_view key = args[static_cast<size_t>(spec->first_key)];
    if (spec->route_key != nullptr) key = spec->route_key(key);
    owner = OwnerOf(conn.tenant, key);
  }
  if (owner == shard.id()) {
    if (check_key) {
      std::string why = cluster_->CheckKey(shard, conn.tenant, *spec,
                                           args[static_cast<size_t>(spec->first_key)], slot, route);
      if (!why.empty()) {
        rb.ErrorLine(why);
        return;
      }
    }
    if (Execute(*spec, shard, (spec->flags & kCmdConnection) ? &conn : nullptr, conn.tenant,
                conn.id(), shard.id(), args, rb, conn.peer(), conn.name, conn.unix_socket)) {
      conn.BeginAsync();  // the reply arrives through the deferred writer
    }
    return;
  }

  auto call = std::make_shared<RemoteCall>();
  call->spec = spec;
  call->args = std::move(args);
  call->tenant = conn.tenant;
  call->client_id = conn.id();
  call->origin = shard.id();
  call->resp = conn.resp_version();
  call->peer = conn.peer();
  call->client_name = conn.name;
  call->unix_socket = conn.unix_socket;
  call->check_key = check_key;
  call->slot = slot;
  call->route = std::move(route);
  const uint64_t conn_id = conn.id();
  bool posted = shards_[owner]->Post([this, call, conn_id](Shard& target) {
    proto::ReplyBuilder remote_rb(&call->reply, call->resp);
    bool deferred = false;
    std::string why;
    if (call->check_key) {
      why = cluster_->CheckKey(target, call->tenant, *call->spec,
                               call->args[static_cast<size_t>(call->spec->first_key)], call->slot,
                               call->route);
    }
    if (!why.empty()) {
      remote_rb.ErrorLine(why);
    } else {
      deferred = Execute(*call->spec, target, nullptr, call->tenant, call->client_id, call->origin,
                         call->args, remote_rb, call->peer, call->client_name, call->unix_socket);
    }
    call->args.Clear();
    if (deferred) return;  // the deferred writer delivers to the origin shard itself
    shards_[call->origin]->PostControl([call, conn_id](Shard& home) {
      if (net::Connection* c = home.FindConnection(conn_id))
        c->CompleteAsync(std::move(call->reply));
    });
  });
  if (!posted) {
    args = std::move(call->args);
    st.Reject(RejectReason::kBusy);
    Bump(cs.rejected);
    rb.ErrorLine("BUSY shard " + std::to_string(owner) + " inbox is full (" +
                 std::to_string(shards_[owner]->queued()) + " queued); retry later");
    return;
  }
  Bump(st.forwarded_commands);
  conn.BeginAsync();
}

bool Server::ClusterCheck(const CommandSpec& spec, const proto::CmdArgs& args, bool asking,
                          int* slot, SlotRoute* route, std::string* error) {
  const int n = static_cast<int>(args.size());
  const int first = spec.first_key;
  int last = spec.last_key < 0 ? n + spec.last_key : std::max(spec.last_key, first);
  if (last >= n) last = n - 1;
  const int step = spec.key_step > 0 ? spec.key_step : 1;
  *slot = cluster::KeySlot(args[static_cast<size_t>(first)]);
  bool cross = false;
  for (int i = first + step; i <= last && !cross; i += step) {
    cross = cluster::KeySlot(args[static_cast<size_t>(i)]) != *slot;
  }
  if (spec.more_keys != nullptr && !cross) {
    std::vector<std::string_view> more;
    spec.more_keys(args, &more);
    for (std::string_view k : more) cross = cross || cluster::KeySlot(k) != *slot;
  }
  if (cross) {
    *error = "CROSSSLOT Keys in request don't hash to the same slot";
    return false;
  }
  *route = cluster_->Route(*slot, asking);
  switch (route->kind) {
    case SlotRoute::Kind::kServe:
    case SlotRoute::Kind::kCheckKey:
      return true;
    case SlotRoute::Kind::kMoved:
      *error = "MOVED " + std::to_string(*slot) + " " + route->addr;
      return false;
    case SlotRoute::Kind::kUnassigned:
      break;
  }
  *error = "CLUSTERDOWN Hash slot not served";
  return false;
}

bool Server::Execute(const CommandSpec& spec, Shard& shard, net::Connection* conn, uint32_t tenant,
                     uint64_t client_id, int origin_shard, proto::CmdArgs& args,
                     proto::ReplyBuilder& rb, std::string_view peer, std::string_view client_name,
                     bool unix_socket) {
  // Consecutive commands of a pipelined batch share a clock reading (the end of one is the
  // start of the next) as long as no socket I/O happened in between: one read per command.
  using Clock = std::chrono::steady_clock;
  thread_local uint64_t last_epoch = ~uint64_t{0};
  thread_local Clock::time_point last_end;
  net::EventLoop& loop = shard.loop();
  const Clock::time_point t0 = last_epoch == loop.io_epoch() ? last_end : Clock::now();
  rb.ResetErrorCount();
  CommandContext ctx{this, &shard, &rb, tenant, client_id, conn};
  ctx.origin_shard = origin_shard;
  ctx.resp = rb.version();
  ctx.unix_socket = unix_socket;
  ctx.spec = &spec;
  ctx.args = &args;
  ctx.start = t0;
  residency::PinSet pins;
  ctx.pins = &pins;
  Status admission;
  if ((spec.flags & kCmdWrite) && writes_paused()) admission = WritesPausedError();
  if (admission.ok() && (spec.flags & (kCmdDeadline | kCmdApprox))) {
    int64_t ms = config_.default_deadline_ms;
    admission = TakeAdmission(spec, args, &ms, &ctx.allow_approx);
    if (ms > 0) ctx.deadline = t0 + std::chrono::milliseconds(ms);
  }
  if (admission.ok()) {
    spec.handler(ctx, args);
  } else {
    ctx.Error(admission);
  }
  pins.Reset();
  const Clock::time_point t1 = Clock::now();
  last_end = t1;
  last_epoch = loop.io_epoch();
  auto us =
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(t1 - t0).count());
  // A deferred command is recorded when its reply is written (CommandContext::Defer).
  if (!ctx.deferred) shard.stats().commands[spec.index].Record(us, rb.errors() > 0);
  int64_t slower_than = settings_.slowlog_log_slower_than_us.load(std::memory_order_relaxed);
  if (slower_than >= 0 && us >= static_cast<uint64_t>(slower_than) && !args.empty()) {
    slowlog_.Add(args, us, std::string(peer), std::string(client_name),
                 static_cast<size_t>(settings_.slowlog_max_len.load(std::memory_order_relaxed)));
  }
  return ctx.deferred;
}

}  // namespace pion::server
