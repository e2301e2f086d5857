#include "server/command.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>

#include "net/connection.h"
#include "server/server.h"
#include "server/shard.h"

namespace pion::server {

namespace {

// A parked command: everything needed to run its handler again on its shard.
struct Parked {
  Server* server;
  const CommandSpec* spec;
  proto::CmdArgs args;
  int shard;
  uint32_t tenant;
  uint64_t client_id;
  int origin;
  int resp;
  bool unix_socket;
  residency::Deadline deadline;
  bool allow_approx;
  int reruns;
  std::chrono::steady_clock::time_point start;
  std::function<void(CommandContext::ReplyWriter)> reply;
};

// A command that moved this often found its objects gone again every time: something keeps
// demoting them (far too little memory for the working set). Say so instead of looping.
constexpr int kMaxReruns = 8;

void CountRejection(Shard& shard, const Status& status) {
  if (status.kind() == ErrorKind::kOom) shard.stats().Reject(RejectReason::kOom);
  if (status.kind() == ErrorKind::kBusy) shard.stats().Reject(RejectReason::kBusy);
  if (status.kind() == ErrorKind::kTimeout) shard.stats().Reject(RejectReason::kTimeout);
}

// Runs on the command's shard: the handler again, with the pins the wait took.
void Rerun(const std::shared_ptr<Parked>& p, Shard& shard, residency::PinSet pins) {
  proto::ReplyBuffer buf;
  proto::ReplyBuilder rb(&buf, p->resp);
  CommandContext ctx{p->server, &shard, &rb, p->tenant, p->client_id, nullptr};
  ctx.origin_shard = p->origin;
  ctx.resp = p->resp;
  ctx.unix_socket = p->unix_socket;
  ctx.spec = p->spec;
  ctx.args = &p->args;
  ctx.deadline = p->deadline;
  ctx.allow_approx = p->allow_approx;
  ctx.reruns = p->reruns + 1;
  ctx.start = p->start;
  ctx.pins = &pins;
  if ((p->spec->flags & kCmdWrite) && p->server->writes_paused()) {
    ctx.Error(WritesPausedError());  // parked before SHUTDOWN SAVE began: refused like the rest
  } else {
    p->spec->handler(ctx, p->args);
  }
  if (ctx.deferred) return;  // it replies through its own deferred writer
  auto out = std::make_shared<proto::ReplyBuffer>(std::move(buf));
  p->reply([out](proto::ReplyBuilder& target) { target.buffer()->Splice(std::move(*out)); });
}

}  // namespace

std::string AdmissionOptionsHint(const CommandSpec* spec) {
  std::string out;
  if (spec != nullptr && (spec->flags & kCmdDeadline)) out += ", DEADLINE <ms>";
  if (spec != nullptr && (spec->flags & kCmdApprox)) out += ", ALLOW APPROX";
  return out;
}

Status WritesPausedError() {
  return Status(ErrorKind::kBusy,
                "the server is shutting down: SHUTDOWN SAVE is saving every object and refuses "
                "writes meanwhile");
}

void CommandContext::Error(const Status& status) {
  CountRejection(*shard, status);
  rb->Error(status);
}

void CommandContext::WrongArity() {
  shard->stats().Reject(RejectReason::kArity);
  rb->ErrorLine(ArityError(spec != nullptr ? spec->lower_name : std::string("?")));
}

bool CommandContext::Resident(const std::vector<residency::ObjectRef>& objs, residency::Tier tier) {
  residency::Engine* engine = server->residency();
  if (engine->TryPinAll(objs, tier, pins)) return true;
  const residency::Deadline dl = deadline;
  Park([engine, objs, tier, dl](auto done) { engine->Require(objs, tier, dl, std::move(done)); });
  return false;
}

bool CommandContext::Room(residency::Tier tier, residency::Family family, uint64_t bytes) {
  residency::Engine* engine = server->residency();
  if (engine->RoomNow(tier, family, bytes)) return true;
  const residency::Deadline dl = deadline;
  Park([engine, tier, family, bytes, dl](auto done) {
    engine->MakeRoom(tier, family, bytes, dl,
                     [done = std::move(done)](const Status& s) { done(s, residency::PinSet()); });
  });
  return false;
}

void CommandContext::ParkUntil(std::function<void(std::function<void(const Status&)>)> wait) {
  Park([wait = std::move(wait)](auto done) {
    wait([done = std::move(done)](const Status& s) { done(s, residency::PinSet()); });
  });
}

residency::PinSet CommandContext::TakePins() {
  residency::PinSet out;
  if (pins != nullptr) out = std::move(*pins);
  return out;
}

void CommandContext::Park(Wait wait) {
  if (reruns >= kMaxReruns) {
    return Error(Status(ErrorKind::kBusy,
                        "the objects this command needs were demoted again each time they were "
                        "brought in (" +
                            std::to_string(reruns) +
                            " times): the memory budget is far below the working set; retry"));
  }
  auto p = std::make_shared<Parked>();
  p->server = server;
  p->spec = spec;
  p->args = std::move(*args);
  p->shard = shard->id();
  p->tenant = tenant;
  p->client_id = client_id;
  p->origin = origin_shard;
  p->resp = resp;
  p->unix_socket = unix_socket;
  p->deadline = deadline;
  p->allow_approx = allow_approx;
  p->reruns = reruns;
  p->start = start;
  p->reply = Defer();
  wait([p](const Status& s, residency::PinSet pins) {
    auto held = std::make_shared<residency::PinSet>(std::move(pins));
    p->server->shard(p->shard).PostControl([p, s, held](Shard& sh) {
      if (!s.ok()) {
        CountRejection(sh, s);
        return p->reply([s](proto::ReplyBuilder& rb) { rb.Error(s); });
      }
      Rerun(p, sh, std::move(*held));
    });
  });
}

std::function<void(CommandContext::ReplyWriter)> CommandContext::Defer() {
  deferred = true;
  Server* srv = server;
  const int origin = origin_shard;
  const uint64_t conn_id = client_id;
  const int version = resp;
  const size_t index = spec != nullptr ? spec->index : SIZE_MAX;
  const auto t0 = start;
  return [srv, origin, conn_id, version, index, t0](ReplyWriter write) {
    srv->shard(origin).PostControl(
        [conn_id, version, index, t0, write = std::move(write)](Shard& home) {
          proto::ReplyBuffer buf;
          proto::ReplyBuilder rb(&buf, version);
          write(rb);
          // The command ends here: its latency runs to this reply, and an error in it counts.
          if (index != SIZE_MAX && t0 != std::chrono::steady_clock::time_point{}) {
            const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                                std::chrono::steady_clock::now() - t0)
                                .count();
            home.stats().commands[index].Record(static_cast<uint64_t>(us), rb.errors() > 0);
          }
          net::Connection* c = home.FindConnection(conn_id);
          if (c == nullptr) return;  // the client went away meanwhile
          c->CompleteAsync(std::move(buf));
        });
  };
}

void CommandRegistry::Register(CommandSpec spec) {
  for (char& c : spec.name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  spec.lower_name = spec.name;
  for (char& c : spec.lower_name)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (by_name_.count(spec.name)) {
    std::fprintf(stderr, "duplicate command registration: %s\n", spec.name.c_str());
    std::abort();
  }
  // The admission options every such command takes, in its grammar (COMMAND DOCS).
  if ((spec.flags & kCmdDeadline) && spec.syntax.find("DEADLINE") == std::string::npos) {
    spec.syntax += " [DEADLINE <ms>]";
  }
  if ((spec.flags & kCmdApprox) && spec.syntax.find("ALLOW APPROX") == std::string::npos) {
    spec.syntax += " [ALLOW APPROX]";
  }
  spec.index = specs_.size();
  by_name_.emplace(spec.name, spec.index);
  specs_.push_back(std::move(spec));
}

const CommandSpec* CommandRegistry::Find(std::string_view name) const {
  char upper[64];
  if (name.empty() || name.size() > sizeof(upper)) return nullptr;
  for (size_t i = 0; i < name.size(); ++i) {
    upper[i] = static_cast<char>(std::toupper(static_cast<unsigned char>(name[i])));
  }
  auto it = by_name_.find(std::string_view(upper, name.size()));
  return it == by_name_.end() ? nullptr : &specs_[it->second];
}

std::string UnknownCommandError(const proto::CmdArgs& args) {
  std::string name(args[0].substr(0, 128));
  std::string msg = "ERR unknown command '" + name + "', with args beginning with: ";
  for (size_t i = 1; i < args.size() && msg.size() < 256; ++i) {
    msg += "'" + std::string(args[i].substr(0, 64)) + "' ";
  }
  return msg;
}

std::string ArityError(std::string_view lower_name) {
  return "ERR wrong number of arguments for '" + std::string(lower_name) + "' command";
}

std::string UnknownSubcommandError(std::string_view sub, std::string_view lower_name) {
  std::string upper(lower_name);
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return "ERR unknown subcommand '" + std::string(sub.substr(0, 64)) + "'. Try " + upper + " HELP.";
}

}  // namespace pion::server
