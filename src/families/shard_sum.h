// Totals over every shard for the caller's tenant (STATE.INFO, V.INFO, KV.PREFIX.INFO).
#pragma once

#include <functional>
#include <string_view>
#include <vector>

#include "server/command.h"
#include "server/shard.h"

namespace pion::families {

struct SumField {
  std::string_view name;
  bool fractional = false;  // replied as a double; otherwise as an integer
};

// Runs `per_shard` on every shard (it returns one value per field, in order), sums the
// values, and replies a map field -> total. Needs a kCmdConnection command (fan-out).
void ReplySumOverShards(server::CommandContext& ctx, std::vector<SumField> fields,
                        std::function<std::vector<double>(server::Shard&)> per_shard);

}  // namespace pion::families
