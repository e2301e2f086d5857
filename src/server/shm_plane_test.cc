// ShmPlane ownership at server teardown: the tenants' arenas belong to the plane and go with
// the Server, after everything that holds their buffers.
#include "server/shm_plane.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "families/families.h"
#include "server/server.h"

namespace pion::server {
namespace {

// Found by fuzz/command_fuzz (LeakSanitizer at exit): the arenas were raw pointers the plane
// never deleted, because stores destroyed after the plane still freed regions into them. Under
// ASan/LSan (make asan) this test fails on a leak or a use after free; in any build it checks
// that a stored buffer and a lease both survive until the Server goes.
TEST(ShmPlane, ServerTeardownFreesArenasAfterTheirBuffers) {
  char dir[] = "/tmp/pion-shm-plane-test.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  Config c;
  c.port = 0;
  c.binary_port = 0;
  c.metrics_port = 0;
  c.workers = 1;
  c.io_threads = 1;
  c.compute_threads = 1;
  c.dir = std::string(dir) + "/data";
  c.unixsocket = std::string(dir) + "/pion.sock";
  c.maxmemory_auto = false;
  c.disk_quota_auto = false;
  {
    auto s = std::make_unique<Server>(c);
    families::RegisterAll(*s);
    ASSERT_TRUE(s->Init().ok());
    ASSERT_TRUE(s->shm().enabled());
    auto stored = s->shm().AllocatorFor(3)->Allocate(1 << 16);  // as a V.* chunk is
    auto leased = s->shm().AllocatorFor(3)->Allocate(4096);
    ASSERT_TRUE(stored.ok() && leased.ok());
    EXPECT_EQ(s->shm().stats().arenas, 1u);
    auto lease = s->shm().Grant(/*client=*/7, {leased.value()}, 4096);
    ASSERT_TRUE(lease.ok());
    leased = BufferRef();
    // Held by a member destroyed before the arenas (as the shards' stores and the engine's
    // replicas are); never run, since Init() is done.
    s->AddShardInit([b = std::move(stored).value()](Shard&) {});
    EXPECT_EQ(s->shm().LeasesOf(7), 1u);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pion::server
