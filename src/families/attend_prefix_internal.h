// Helpers shared by the ATTEND.PREFIX command files (attend_prefix_family.cc: slots, STORE,
// STORE FROM, LOOKUP, DROP, INFO; attend_prefix_query.cc: the QUERY forms). Not a public
// interface.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "attention/slot_store.h"
#include "common/status.h"
#include "kernels/attention.h"
#include "server/command.h"

namespace pion::server {
class Server;
}

namespace pion::families::attend {

// The head dims every backend supports.
inline constexpr uint32_t kHeadDims[] = {32, 64, 96, 128, 160, 192, 256, 512};
inline constexpr uint32_t kMaxHeads = 1024;
inline constexpr uint32_t kMaxRows = 1u << 26;  // tokens per slot
inline constexpr uint32_t kMaxLayer = 1u << 20;

Status ParseLayer(std::string_view text, uint32_t* out);
// "<what> must be in [1, max], got x".
Status ParseCount(std::string_view text, std::string_view what, uint32_t max, uint32_t* out);
// D: one of kHeadDims.
Status ParseHeadDim(std::string_view text, uint32_t* out);

// "<what> must be <formula> = <expected> bytes (<shape>), got <got>".
Status CheckBlobSize(std::string_view what, std::string_view formula, uint64_t expected,
                     uint64_t got);

// The slot for (sid, layer) on the calling shard, or kMiss naming both.
StatusOr<attention::SlotRef> FindSlot(server::CommandContext& ctx, std::string_view sid,
                                      uint32_t layer);

// The backend that computes ATTEND.PREFIX queries (--attention-backend).
const kernels::AttentionKernels& Kernels(server::Server& srv);
std::string_view BackendName(server::Server& srv);

void RegisterQueryCommands(server::Server& srv);

}  // namespace pion::families::attend
