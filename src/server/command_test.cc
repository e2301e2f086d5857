#include "server/command.h"

#include <gtest/gtest.h>

namespace pion::server {
namespace {

void Noop(CommandContext&, proto::CmdArgs&) {}

TEST(CommandRegistry, CaseInsensitiveLookupAndIndexes) {
  CommandRegistry r;
  r.Register({"ping", -1, kCmdFast, 0, 0, 0, Noop, "connection", "", ""});
  r.Register({"STATE.READ", 4, kCmdReadOnly, 1, 1, 1, Noop, "state", "", ""});
  ASSERT_NE(r.Find("PING"), nullptr);
  EXPECT_EQ(r.Find("PiNg")->name, "PING");
  EXPECT_EQ(r.Find("ping")->lower_name, "ping");
  EXPECT_EQ(r.Find("state.read")->index, 1u);
  EXPECT_EQ(r.Find("state.read")->first_key, 1);
  EXPECT_EQ(r.Find("nope"), nullptr);
  EXPECT_EQ(r.Find(""), nullptr);
  EXPECT_EQ(r.Find(std::string(200, 'P')), nullptr);
  EXPECT_EQ(r.size(), 2u);
}

TEST(CommandRegistryDeathTest, DuplicateNamesAbort) {
  CommandRegistry r;
  r.Register({"PING", -1, 0, 0, 0, 0, Noop, "", "", ""});
  EXPECT_DEATH(r.Register({"ping", -1, 0, 0, 0, 0, Noop, "", "", ""}), "duplicate");
}

TEST(CommandErrors, RedisTexts) {
  proto::CmdArgs args;
  args.AppendSmall("foo");
  args.AppendSmall("a");
  args.AppendSmall("b");
  EXPECT_EQ(UnknownCommandError(args),
            "ERR unknown command 'foo', with args beginning with: 'a' 'b' ");
  EXPECT_EQ(ArityError("get"), "ERR wrong number of arguments for 'get' command");
  EXPECT_EQ(UnknownSubcommandError("x", "client"), "ERR unknown subcommand 'x'. Try CLIENT HELP.");
}

}  // namespace
}  // namespace pion::server
