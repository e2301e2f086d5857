// CLIENT ID|SETNAME|GETNAME|LIST|KILL|INFO|HELP.
//
// Connections are owned by the shard that accepted them, so LIST and KILL fan out to every
// shard (as control messages) and combine the answers. A connection sees and kills only
// connections of its own tenant; tenant 'default' (the administrator) sees all.
#include <chrono>
#include <sstream>

#include "families/args.h"
#include "families/families.h"
#include "net/connection.h"
#include "server/server.h"

namespace pion::families {
namespace {

using proto::CmdArgs;
using server::CommandContext;

std::string Describe(server::Server& srv, const server::Shard& shard, const net::Connection& c) {
  using std::chrono::duration_cast;
  using std::chrono::seconds;
  auto now = net::Connection::Clock::now();
  std::ostringstream o;
  o << "id=" << c.id() << " addr=" << c.peer() << " laddr=" << c.local() << " fd=" << c.fd()
    << " name=" << c.name << " age=" << duration_cast<seconds>(now - c.created()).count()
    << " idle=" << duration_cast<seconds>(now - c.last_active()).count()
    << " flags=" << (c.unix_socket ? "U" : "N") << " db=0 qbuf=" << c.query_buffer_bytes()
    << " omem=" << c.output_bytes() << " cmd=" << (c.last_command.empty() ? "NULL" : c.last_command)
    << " user=" << c.user << " tenant=" << srv.users().TenantName(c.tenant)
    << " resp=" << c.resp_version() << " shard=" << shard.id() << "\n";
  return o.str();
}

bool Visible(uint32_t viewer_tenant, const net::Connection& c) {
  return viewer_tenant == server::kDefaultTenant || c.tenant == viewer_tenant;
}

void ClientList(CommandContext& ctx, CmdArgs& args) {
  std::vector<uint64_t> ids;
  if (args.size() > 2) {
    if (!EqualsIgnoreCase(args[2], "ID") || args.size() < 4) {
      ctx.rb->ErrorLine("ERR syntax error: CLIENT LIST [ID client-id ...]");
      return;
    }
    for (size_t i = 3; i < args.size(); ++i) {
      uint64_t id;
      if (!ParseUint(args[i], "client-id", &id).ok()) {
        ctx.rb->ErrorLine("ERR Invalid client ID");
        return;
      }
      ids.push_back(id);
    }
  }
  auto& srv = *ctx.server;
  uint32_t tenant = ctx.conn->tenant;
  srv.FanOut(
      *ctx.shard, *ctx.conn,
      [&srv, tenant, ids](server::Shard& shard) {
        std::string out;
        shard.ForEachConnection([&](net::Connection& c) {
          if (!Visible(tenant, c)) return;
          if (!ids.empty() && std::find(ids.begin(), ids.end(), c.id()) == ids.end()) return;
          out += Describe(srv, shard, c);
        });
        return out;
      },
      [](std::vector<std::string>& parts, proto::ReplyBuilder& rb) {
        std::string all;
        for (auto& p : parts) all += p;
        rb.Verbatim(all);
      });
}

// CLIENT KILL <ip:port> | CLIENT KILL [ID id] [ADDR ip:port] [LADDR ip:port] [USER u]
// [SKIPME yes|no]
void ClientKill(CommandContext& ctx, CmdArgs& args) {
  struct Filter {
    bool old_form = false;
    int64_t id = -1;
    std::string addr, laddr, user;
    bool skipme = true;
  } f;
  if (args.size() == 3) {
    f.old_form = true;
    f.addr = std::string(args[2]);
  } else {
    if (args.size() % 2 != 0) {
      ctx.rb->ErrorLine("ERR syntax error");
      return;
    }
    for (size_t i = 2; i + 1 < args.size(); i += 2) {
      std::string_view k = args[i], v = args[i + 1];
      if (EqualsIgnoreCase(k, "ID")) {
        if (!ParseInt64(v, &f.id) || f.id < 0) {
          ctx.rb->ErrorLine("ERR client-id should be greater than 0");
          return;
        }
      } else if (EqualsIgnoreCase(k, "ADDR")) {
        f.addr = std::string(v);
      } else if (EqualsIgnoreCase(k, "LADDR")) {
        f.laddr = std::string(v);
      } else if (EqualsIgnoreCase(k, "USER")) {
        f.user = std::string(v);
      } else if (EqualsIgnoreCase(k, "SKIPME")) {
        if (EqualsIgnoreCase(v, "yes")) {
          f.skipme = true;
        } else if (EqualsIgnoreCase(v, "no")) {
          f.skipme = false;
        } else {
          ctx.rb->ErrorLine("ERR syntax error");
          return;
        }
      } else {
        ctx.rb->ErrorLine("ERR syntax error");
        return;
      }
    }
  }
  uint32_t tenant = ctx.conn->tenant;
  uint64_t self = ctx.conn->id();
  ctx.server->FanOut(
      *ctx.shard, *ctx.conn,
      [f, tenant, self](server::Shard& shard) {
        std::vector<net::Connection*> victims;
        shard.ForEachConnection([&](net::Connection& c) {
          if (!Visible(tenant, c)) return;
          if (f.id >= 0 && c.id() != static_cast<uint64_t>(f.id)) return;
          if (!f.addr.empty() && c.peer() != f.addr) return;
          if (!f.laddr.empty() && c.local() != f.laddr) return;
          if (!f.user.empty() && c.user != f.user) return;
          if (c.id() == self && (f.skipme && !f.old_form)) return;
          victims.push_back(&c);
        });
        for (auto* c : victims) {
          // The caller's own connection is closed after its reply, not under its feet.
          if (c->id() == self) {
            c->CloseAfterReply();
          } else {
            c->Close(net::CloseReason::kKilled);
          }
        }
        return std::to_string(victims.size());
      },
      [f](std::vector<std::string>& parts, proto::ReplyBuilder& rb) {
        int64_t n = 0;
        for (auto& p : parts) n += std::stoll(p);
        if (f.old_form) {
          if (n == 0) {
            rb.ErrorLine("ERR No such client");
          } else {
            rb.Ok();
          }
        } else {
          rb.Integer(n);
        }
      });
}

void Client(CommandContext& ctx, CmdArgs& args) {
  std::string_view sub = args[1];
  net::Connection& conn = *ctx.conn;
  auto& rb = *ctx.rb;
  if (EqualsIgnoreCase(sub, "ID") && args.size() == 2) {
    rb.Integer(static_cast<int64_t>(conn.id()));
  } else if (EqualsIgnoreCase(sub, "SETNAME") && args.size() == 3) {
    if (!ValidClientName(args[2])) {
      rb.ErrorLine(kBadClientName);
      return;
    }
    conn.name = std::string(args[2]);
    rb.Ok();
  } else if (EqualsIgnoreCase(sub, "GETNAME") && args.size() == 2) {
    if (conn.name.empty()) {
      rb.Null();
    } else {
      rb.Bulk(conn.name);
    }
  } else if (EqualsIgnoreCase(sub, "INFO") && args.size() == 2) {
    rb.Verbatim(Describe(*ctx.server, *ctx.shard, conn));
  } else if (EqualsIgnoreCase(sub, "LIST")) {
    ClientList(ctx, args);
  } else if (EqualsIgnoreCase(sub, "KILL") && args.size() >= 3) {
    ClientKill(ctx, args);
  } else if (EqualsIgnoreCase(sub, "HELP")) {
    static const char* kHelp[] = {
        "CLIENT <subcommand> [<arg> ...]. Subcommands are:",
        "ID",
        "    Return the ID of the current connection.",
        "SETNAME <name>",
        "    Assign the name <name> to the current connection.",
        "GETNAME",
        "    Return the name of the current connection.",
        "INFO",
        "    Return information about the current connection.",
        "LIST [ID <id> ...]",
        "    Return information about client connections of your tenant.",
        "KILL <ip:port> | KILL [ID <id>] [ADDR <ip:port>] [LADDR <ip:port>] [USER <user>] "
        "[SKIPME yes|no]",
        "    Kill connections of your tenant.",
        "HELP",
        "    Print this help."};
    rb.Array(std::size(kHelp));
    for (const char* l : kHelp) rb.SimpleString(l);
  } else {
    rb.ErrorLine(server::UnknownSubcommandError(sub, "client"));
  }
}

}  // namespace

void RegisterClientFamily(server::Server& srv) {
  using namespace server;
  srv.registry().Register({"CLIENT", -2, kCmdConnection, 0, 0, 0, Client, "connection",
                           "Inspects and manages client connections.",
                           "ID|SETNAME name|GETNAME|INFO|LIST [ID id ...]|KILL ...|HELP"});
}

}  // namespace pion::families
