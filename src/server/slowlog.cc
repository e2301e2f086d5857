#include "server/slowlog.h"

#include <cctype>
#include <ctime>

namespace pion::server {
namespace {
constexpr size_t kMaxArgs = 32;
constexpr size_t kMaxArgLen = 128;
bool IEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

// Which arguments carry secrets: every AUTH argument, the two after HELLO's AUTH, and the
// value of CONFIG SET requirepass. Those are logged as "(redacted)", as Redis does.
std::vector<bool> SecretArgs(const proto::CmdArgs& args) {
  std::vector<bool> secret(args.size(), false);
  if (args.empty()) return secret;
  if (IEquals(args[0], "AUTH")) {
    for (size_t i = 1; i < args.size(); ++i) secret[i] = true;
  } else if (IEquals(args[0], "HELLO")) {
    for (size_t i = 2; i < args.size(); ++i) {
      if (IEquals(args[i], "AUTH")) {
        for (size_t j = i + 1; j < args.size() && j <= i + 2; ++j) secret[j] = true;
      }
    }
  } else if (IEquals(args[0], "CONFIG") && args.size() > 1 && IEquals(args[1], "SET")) {
    for (size_t i = 2; i + 1 < args.size(); i += 2) {
      if (IEquals(args[i], "requirepass")) secret[i + 1] = true;
    }
  }
  return secret;
}

}  // namespace

void SlowLog::Add(const proto::CmdArgs& args, uint64_t duration_us, std::string peer,
                  std::string client_name, size_t max_len) {
  SlowLogEntry e;
  e.unix_time = static_cast<int64_t>(std::time(nullptr));
  e.duration_us = duration_us;
  size_t n = args.size() < kMaxArgs ? args.size() : kMaxArgs - 1;
  std::vector<bool> secret = SecretArgs(args);
  for (size_t i = 0; i < n; ++i) {
    std::string_view a = args[i];
    if (secret[i]) {
      e.args.emplace_back("(redacted)");
    } else if (a.size() > kMaxArgLen) {
      e.args.push_back(std::string(a.substr(0, kMaxArgLen)) + "... (" +
                       std::to_string(a.size() - kMaxArgLen) + " more bytes)");
    } else {
      e.args.emplace_back(a);
    }
  }
  if (args.size() > n) {
    e.args.push_back("... (" + std::to_string(args.size() - n) + " more arguments)");
  }
  e.peer = std::move(peer);
  e.client_name = std::move(client_name);
  std::lock_guard<std::mutex> lock(mu_);
  e.id = next_id_++;
  entries_.push_front(std::move(e));
  while (entries_.size() > max_len) entries_.pop_back();
}

std::vector<SlowLogEntry> SlowLog::Get(size_t count) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SlowLogEntry> out;
  for (size_t i = 0; i < entries_.size() && i < count; ++i) out.push_back(entries_[i]);
  return out;
}

size_t SlowLog::Len() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void SlowLog::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.clear();
}

}  // namespace pion::server
