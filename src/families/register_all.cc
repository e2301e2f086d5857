#include "families/families.h"
#include "families/save_all.h"

namespace pion::families {

void RegisterAll(server::Server& server) {
  RegisterServerFamily(server);
  RegisterClientFamily(server);
  RegisterConfigFamily(server);
  RegisterInfoFamily(server);
  RegisterStateFamily(server);
  RegisterVStoreFamily(server);
  RegisterSsmFamily(server);
  RegisterKvPrefixFamily(server);
  RegisterAttendPrefixFamily(server);
  RegisterAttendIndexFamily(server);
  RegisterKvCacheFamily(server);
  RegisterShmFamily(server);
  RegisterExitReport(server);
  RegisterClusterFamily(server);  // last: it joins after every family found its saved objects
}

}  // namespace pion::families
