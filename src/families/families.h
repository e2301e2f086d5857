// Command families: each registers its commands into the server's command table.
// A family parses and validates arguments and shapes replies; the data structures it drives
// live in store/ (and kernels/) and know nothing about RESP.
#pragma once

namespace pion::server {
class Server;
}

namespace pion::families {

void RegisterServerFamily(server::Server& server);    // PING ECHO HELLO AUTH QUIT SHUTDOWN COMMAND
void RegisterClientFamily(server::Server& server);    // CLIENT
void RegisterConfigFamily(server::Server& server);    // CONFIG
void RegisterInfoFamily(server::Server& server);      // INFO SLOWLOG
void RegisterStateFamily(server::Server& server);     // STATE.*
void RegisterVStoreFamily(server::Server& server);    // V.*
void RegisterSsmFamily(server::Server& server);       // SSM.PREFIX.*
void RegisterKvPrefixFamily(server::Server& server);  // KV.PREFIX.*
void RegisterAttendPrefixFamily(server::Server& server);  // ATTEND.PREFIX.*
void RegisterKvCacheFamily(server::Server& server);       // KV.STORE KV.FETCH KV.INFO KV.EVICT
void RegisterAttendIndexFamily(server::Server& server);   // ATTEND.CREATE/STORE/FINALIZE/QUERY/...
void RegisterShmFamily(server::Server& server);           // SHM.* (same-host data plane)
void RegisterClusterFamily(server::Server& server);  // CLUSTER ASKING READONLY READWRITE CLUSTER.*

// Every family, in table order.
void RegisterAll(server::Server& server);

}  // namespace pion::families
