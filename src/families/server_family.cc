// PING, ECHO, HELLO, AUTH, QUIT, SHUTDOWN, COMMAND.
#include <spdlog/spdlog.h>

#include "families/args.h"
#include "families/families.h"
#include "families/save_all.h"
#include "net/connection.h"
#include "server/server.h"

namespace pion::families {
namespace {

using proto::CmdArgs;
using server::CommandContext;
using server::CommandSpec;

constexpr const char* kVersion = "0.1.0";

void Ping(CommandContext& ctx, CmdArgs& args) {
  if (args.size() > 2) {
    ctx.rb->ErrorLine(server::ArityError("ping"));
    return;
  }
  if (args.size() == 2) {
    ctx.rb->Bulk(args[1]);
  } else {
    ctx.rb->SimpleString("PONG");
  }
}

void Echo(CommandContext& ctx, CmdArgs& args) {
  if (args.IsBuffer(1)) {
    auto buf = args.TakeBuffer(1);  // the parser's own buffer: replied without a copy
    ctx.rb->BulkRef(buf.value());
  } else {
    ctx.rb->Bulk(args[1]);
  }
}

// Authenticates conn as user/password. Writes the error reply and returns false on failure.
bool DoAuth(CommandContext& ctx, std::string_view user, std::string_view password) {
  auto& srv = *ctx.server;
  if (!srv.settings().auth_required.load() && user == "default") {
    // With auth off the default user has no password (as in Redis): any password is accepted.
    ctx.conn->authenticated = true;
    return true;
  }
  auto tenant = srv.users().Authenticate(user, password);
  if (!tenant) {
    ctx.shard->stats().Reject(server::RejectReason::kWrongPass);
    ctx.rb->ErrorLine("WRONGPASS invalid username-password pair or user is disabled.");
    return false;
  }
  ctx.conn->authenticated = true;
  ctx.conn->user = std::string(user);
  ctx.conn->tenant = *tenant;
  return true;
}

void Auth(CommandContext& ctx, CmdArgs& args) {
  if (args.size() > 3) {
    ctx.rb->ErrorLine("ERR syntax error");
    return;
  }
  if (!ctx.server->settings().auth_required.load()) {
    ctx.rb->ErrorLine(
        "ERR AUTH <password> called without any password configured for the default user. "
        "Are you sure your configuration is correct?");
    return;
  }
  std::string_view user = args.size() == 3 ? args[1] : std::string_view("default");
  std::string_view pass = args.size() == 3 ? args[2] : args[1];
  if (DoAuth(ctx, user, pass)) ctx.rb->Ok();
}

void Hello(CommandContext& ctx, CmdArgs& args) {
  net::Connection& conn = *ctx.conn;
  int proto = conn.resp_version();
  size_t i = 1;
  if (args.size() > 1) {
    int64_t v = 0;
    if (!ParseInt64(args[1], &v)) {
      ctx.rb->ErrorLine("ERR Protocol version is not an integer or out of range");
      return;
    }
    if (v != 2 && v != 3) {
      ctx.rb->ErrorLine("NOPROTO unsupported protocol version");
      return;
    }
    proto = static_cast<int>(v);
    i = 2;
  }
  // Parse and validate every option before acting on any: a refused HELLO changes nothing.
  std::string_view setname, auth_user, auth_pass;
  bool has_setname = false, has_auth = false;
  for (; i < args.size(); ++i) {
    bool more = i + 1 < args.size();
    if (EqualsIgnoreCase(args[i], "AUTH") && i + 2 < args.size()) {
      auth_user = args[i + 1];
      auth_pass = args[i + 2];
      has_auth = true;
      i += 2;
    } else if (EqualsIgnoreCase(args[i], "SETNAME") && more) {
      setname = args[++i];
      has_setname = true;
    } else {
      ctx.rb->ErrorLine("ERR Syntax error in HELLO option '" + std::string(args[i].substr(0, 64)) +
                        "'");
      return;
    }
  }
  if (has_setname && !ValidClientName(setname)) {
    ctx.rb->ErrorLine(kBadClientName);
    return;
  }
  if (!has_auth && !conn.authenticated && ctx.server->settings().auth_required.load()) {
    ctx.rb->ErrorLine(
        "NOAUTH HELLO must be called with the client already authenticated, otherwise the "
        "HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and "
        "select the RESP protocol version at the same time");
    return;
  }
  if (has_auth && !DoAuth(ctx, auth_user, auth_pass)) return;
  if (has_setname) conn.name = std::string(setname);
  conn.set_resp_version(proto);
  auto& rb = *ctx.rb;
  rb.Map(7);
  rb.Bulk("server");
  rb.Bulk("pion");
  rb.Bulk("version");
  rb.Bulk(kVersion);
  rb.Bulk("proto");
  rb.Integer(proto);
  rb.Bulk("id");
  rb.Integer(static_cast<int64_t>(conn.id()));
  rb.Bulk("mode");
  rb.Bulk(ctx.server->cluster() != nullptr ? "cluster" : "standalone");
  rb.Bulk("role");
  rb.Bulk("master");
  rb.Bulk("modules");
  rb.Array(0);
}

void Quit(CommandContext& ctx, CmdArgs&) {
  ctx.rb->Ok();
  ctx.conn->CloseAfterReply();
}

void Shutdown(CommandContext& ctx, CmdArgs& args) {
  bool save = false, nosave = false, force = false;
  for (size_t i = 1; i < args.size(); ++i) {
    std::string_view a = args[i];
    if (EqualsIgnoreCase(a, "SAVE")) {
      save = true;
    } else if (EqualsIgnoreCase(a, "NOSAVE")) {
      nosave = true;
    } else if (EqualsIgnoreCase(a, "FORCE")) {
      force = true;
    } else if (!EqualsIgnoreCase(a, "NOW")) {
      ctx.rb->ErrorLine("ERR syntax error: SHUTDOWN [NOSAVE|SAVE] [NOW] [FORCE]");
      return;
    }
  }
  if (save && nosave) {
    ctx.rb->ErrorLine("ERR syntax error: SHUTDOWN takes SAVE or NOSAVE, not both");
    return;
  }
  server::Server* srv = ctx.server;
  const uint64_t conn_id = ctx.conn->id();
  const std::string peer(ctx.conn->peer());
  if (!save) {
    spdlog::info("SHUTDOWN requested by client {} ({}){}", conn_id, peer, nosave ? ", NOSAVE" : "");
    srv->RequestShutdown();
    // Like Redis, a successful SHUTDOWN closes the connection without a reply.
    ctx.conn->Close(net::CloseReason::kShutdown);
    return;
  }
  // SAVE: every object of every family that is not durable is saved first, with writes
  // refused meanwhile (so what is saved is everything); the server exits once it is durable.
  spdlog::info("SHUTDOWN requested by client {} ({}), SAVE: saving every unsaved object", conn_id,
               peer);
  srv->PauseWrites(true);
  auto reply = ctx.Defer();  // the connection waits; success closes it without a reply
  const int origin = ctx.origin_shard;
  SaveAll(*srv, [srv, reply, origin, conn_id, force](Tally t) {
    const uint64_t failed = FailedSaves(t);
    const std::string saved = DescribeTally(t, false);
    spdlog::info("SHUTDOWN SAVE: saved {}", saved.empty() ? "nothing (all was saved)" : saved);
    if (failed > 0 && !force) {
      srv->PauseWrites(false);
      const std::string why = DescribeTally(t, true);
      spdlog::error("SHUTDOWN SAVE: {} save(s) failed, not shutting down: {}", failed, why);
      return reply([failed, why](proto::ReplyBuilder& rb) {
        rb.Error(Status(ErrorKind::kErr,
                        "Errors trying to SHUTDOWN: " + std::to_string(failed) +
                            " save(s) failed (" + why +
                            "); the server keeps running (SHUTDOWN SAVE FORCE exits anyway)"));
      });
    }
    if (failed > 0) spdlog::warn("SHUTDOWN SAVE FORCE: exiting with {} failed save(s)", failed);
    srv->shard(origin).PostControl([srv, conn_id](server::Shard& home) {
      if (net::Connection* c = home.FindConnection(conn_id)) c->Close(net::CloseReason::kShutdown);
      srv->RequestShutdown();
    });
  });
}

void CommandFlags(const CommandSpec& s, proto::ReplyBuilder& rb) {
  std::vector<const char*> flags;
  if (s.flags & server::kCmdWrite) flags.push_back("write");
  if (s.flags & server::kCmdReadOnly) flags.push_back("readonly");
  if (s.flags & server::kCmdAdmin) flags.push_back("admin");
  if (s.flags & server::kCmdNoAuth) flags.push_back("no_auth");
  if (s.flags & server::kCmdFast) flags.push_back("fast");
  if (s.flags & server::kCmdDenyOom) flags.push_back("denyoom");
  rb.Set(flags.size());
  for (const char* f : flags) rb.SimpleString(f);
}

void CommandInfo(const CommandSpec& s, proto::ReplyBuilder& rb) {
  rb.Array(10);
  rb.Bulk(s.lower_name);
  rb.Integer(s.arity);
  CommandFlags(s, rb);
  rb.Integer(s.first_key);
  rb.Integer(s.last_key);
  rb.Integer(s.key_step);
  rb.Set(0);    // ACL categories
  rb.Set(0);    // tips
  rb.Array(0);  // key specs
  rb.Array(0);  // subcommands
}

void CommandDocs(const CommandSpec& s, proto::ReplyBuilder& rb) {
  rb.Bulk(s.lower_name);
  rb.Map(4);
  rb.Bulk("summary");
  rb.Bulk(s.summary);
  rb.Bulk("since");
  rb.Bulk("0.1.0");
  rb.Bulk("group");
  rb.Bulk(s.group);
  rb.Bulk("syntax");
  rb.Bulk(s.lower_name + (s.syntax.empty() ? "" : " " + s.syntax));
}

void Command(CommandContext& ctx, CmdArgs& args) {
  auto& reg = ctx.server->registry();
  auto& rb = *ctx.rb;
  if (args.size() == 1) {
    rb.Array(reg.size());
    for (const auto& s : reg.all()) CommandInfo(s, rb);
    return;
  }
  std::string_view sub = args[1];
  if (EqualsIgnoreCase(sub, "COUNT") && args.size() == 2) {
    rb.Integer(static_cast<int64_t>(reg.size()));
  } else if (EqualsIgnoreCase(sub, "LIST") && args.size() == 2) {
    rb.Array(reg.size());
    for (const auto& s : reg.all()) rb.Bulk(s.lower_name);
  } else if (EqualsIgnoreCase(sub, "INFO")) {
    if (args.size() == 2) {
      rb.Array(reg.size());
      for (const auto& s : reg.all()) CommandInfo(s, rb);
      return;
    }
    rb.Array(args.size() - 2);
    for (size_t i = 2; i < args.size(); ++i) {
      const CommandSpec* s = reg.Find(args[i]);
      if (s) {
        CommandInfo(*s, rb);
      } else {
        rb.NullArray();
      }
    }
  } else if (EqualsIgnoreCase(sub, "DOCS")) {
    std::vector<const CommandSpec*> list;
    if (args.size() == 2) {
      for (const auto& s : reg.all()) list.push_back(&s);
    } else {
      for (size_t i = 2; i < args.size(); ++i) {
        if (const CommandSpec* s = reg.Find(args[i])) list.push_back(s);
      }
    }
    rb.Map(list.size());
    for (const CommandSpec* s : list) CommandDocs(*s, rb);
  } else if (EqualsIgnoreCase(sub, "HELP")) {
    static const char* kHelp[] = {"COMMAND <subcommand> [<arg> ...]. Subcommands are:",
                                  "(no subcommand)",
                                  "    Return details about all commands.",
                                  "COUNT",
                                  "    Return the total number of commands.",
                                  "LIST",
                                  "    Return the names of all commands.",
                                  "INFO [<command-name> ...]",
                                  "    Return details about the given commands.",
                                  "DOCS [<command-name> ...]",
                                  "    Return documentation of the given commands.",
                                  "HELP",
                                  "    Print this help."};
    rb.Array(std::size(kHelp));
    for (const char* l : kHelp) rb.SimpleString(l);
  } else {
    rb.ErrorLine(server::UnknownSubcommandError(sub, "command"));
  }
}

}  // namespace

void RegisterServerFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  r.Register({"PING", -1, kCmdFast | kCmdNoAuth, 0, 0, 0, Ping, "connection",
              "Replies PONG, or the message given.", "[message]"});
  r.Register({"ECHO", 2, kCmdFast, 0, 0, 0, Echo, "connection",
              "Replies the message (large messages are sent from the received buffer).",
              "message"});
  r.Register({"HELLO", -1, kCmdFast | kCmdNoAuth | kCmdConnection, 0, 0, 0, Hello, "connection",
              "Handshake: selects RESP2/RESP3, optionally authenticates and names the client.",
              "[protover [AUTH username password] [SETNAME clientname]]"});
  r.Register({"AUTH", -2, kCmdFast | kCmdNoAuth | kCmdConnection, 0, 0, 0, Auth, "connection",
              "Authenticates the connection and binds it to the user's tenant.",
              "[username] password"});
  r.Register({"QUIT", -1, kCmdFast | kCmdNoAuth | kCmdConnection, 0, 0, 0, Quit, "connection",
              "Closes the connection after replying OK.", ""});
  r.Register({"SHUTDOWN", -1, kCmdAdmin | kCmdConnection, 0, 0, 0, Shutdown, "server",
              "Stops the server.", "[NOSAVE|SAVE] [NOW] [FORCE]"});
  r.Register({"COMMAND", -1, 0, 0, 0, 0, Command, "server", "Describes the command table.",
              "[COUNT|LIST|INFO [name ...]|DOCS [name ...]]"});
}

}  // namespace pion::families
