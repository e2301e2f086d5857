// The DEBUG.FAULT command and its injector, linked only into the test binary
// pion-server-faults (see fault_family.cc).
#pragma once

namespace pion::server {
class Server;
}

namespace pion::faults {

// Installs the fault table as the process's injector and registers DEBUG.FAULT.
void RegisterFaultFamily(server::Server& srv);

}  // namespace pion::faults
