// Fault injection points (seed 004 §0x0B1): the disk layer and the GPU transfers ask Check()
// before each operation, so a test can make a write fail or come up short, an fsync fail, the
// disk fill up, a read return corrupted bytes, or any of them run slowly — and then verify that
// the server answers with typed errors, loses nothing acknowledged and keeps serving.
//
// Only a test binary installs an Injector (pion-server-faults, with its DEBUG.FAULT command, and
// the unit tests); the release pion-server never does, so there every Check() is one relaxed
// load of a null pointer and returns "no fault".
#pragma once

#include <string_view>

namespace pion::faults {

enum class Point : unsigned char {
  kDiskWrite,  // a write(2)/pwrite(2) of an object file (saved or spill)
  kDiskFsync,  // an fsync(2) of an object file or its directory
  kDiskRead,   // a pread(2) of an object file block
  kGpuCopy,    // a host<->GPU copy of a residency transfer
  kCount
};

enum class Action : unsigned char {
  kNone,
  kError,    // the call fails (EIO / a device error)
  kShort,    // a write stores only half its bytes, then fails
  kNoSpace,  // the call fails with ENOSPC (a full disk)
  kCorrupt,  // a read returns its bytes with one flipped (checksums must catch it)
  kSlow,     // the call is delayed by delay_ms, then proceeds normally
};

struct Fault {
  Action action = Action::kNone;
  int delay_ms = 0;
};

class Injector {
 public:
  virtual ~Injector() = default;
  // The fault for this call. `target` names what is touched: the object file's directory
  // ("spill", "prefixes", "ssm", "state", "attention", "vsnap") or "gpu". Thread-safe.
  virtual Fault Next(Point point, std::string_view target) = 0;
};

// Installs (or with nullptr removes) the process's injector. Test binaries only.
void Install(Injector* injector);

// The fault to apply now; Action::kNone without an injector.
Fault Check(Point point, std::string_view target);

// Sleeps for a kSlow fault's delay; returns the fault for the caller to apply otherwise.
Fault CheckAndDelay(Point point, std::string_view target);

}  // namespace pion::faults
