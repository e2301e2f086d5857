// Process-level readings for INFO and /metrics.
#pragma once

#include <cstdint>

namespace pion::server {

// Resident set size in bytes (from /proc/self/statm); 0 if unavailable.
uint64_t ProcessRssBytes();
// Peak resident set size in bytes (VmHWM); 0 if unavailable.
uint64_t ProcessPeakRssBytes();
// User and system CPU seconds consumed by the process.
void ProcessCpuSeconds(double* user, double* sys);

}  // namespace pion::server
