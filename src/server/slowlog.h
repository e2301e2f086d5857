// SLOWLOG: commands that took longer than --slowlog-log-slower-than microseconds.
// Written only for slow commands, so its mutex is off the normal data path.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "proto/cmd_args.h"

namespace pion::server {

struct SlowLogEntry {
  uint64_t id;
  int64_t unix_time;
  uint64_t duration_us;
  std::vector<std::string> args;  // at most 32, each at most 128 bytes (Redis' rules)
  std::string peer;
  std::string client_name;
};

class SlowLog {
 public:
  void Add(const proto::CmdArgs& args, uint64_t duration_us, std::string peer,
           std::string client_name, size_t max_len);
  std::vector<SlowLogEntry> Get(size_t count) const;
  size_t Len() const;
  void Reset();

 private:
  mutable std::mutex mu_;
  std::deque<SlowLogEntry> entries_;  // newest first
  uint64_t next_id_ = 0;
};

}  // namespace pion::server
