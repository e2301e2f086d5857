#include "server/command.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>

#include "net/connection.h"
#include "server/server.h"
#include "server/shard.h"

namespace pion::server {

void CommandContext::Error(const Status& status) {
  if (status.kind() == ErrorKind::kOom) shard->stats().Reject(RejectReason::kOom);
  if (status.kind() == ErrorKind::kBusy) shard->stats().Reject(RejectReason::kBusy);
  rb->Error(status);
}

std::function<void(CommandContext::ReplyWriter)> CommandContext::Defer() {
  deferred = true;
  Server* srv = server;
  const int origin = origin_shard;
  const uint64_t conn_id = client_id;
  const int version = resp;
  return [srv, origin, conn_id, version](ReplyWriter write) {
    srv->shard(origin).PostControl([conn_id, version, write = std::move(write)](Shard& home) {
      net::Connection* c = home.FindConnection(conn_id);
      if (c == nullptr) return;  // the client went away meanwhile
      proto::ReplyBuffer buf;
      proto::ReplyBuilder rb(&buf, version);
      write(rb);
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
