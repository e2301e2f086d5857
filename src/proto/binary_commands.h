// The binary protocol's commands: their codes, their request payloads, and the RESP command
// each one runs as (so both protocols share handlers, stores, limits and metrics).
//
// Payload fields are little-endian; `str` is a uint16 length and that many bytes; `rest` is
// every byte to the end of the payload. (docs/PROTOCOL.md, "Binary protocol", is the reference.)
//
//   0x01 LAYER.STORE      str sid, u32 layer, rest state     SSM.PREFIX.STORE sid layer state
//   0x02 LAYER.FETCH      str sid, u32 layer                 SSM.PREFIX.FETCH sid layer
//   0x03 PING             rest message (may be empty)        PING [message]
//   0x04 AUTH             str user (empty: default), str password       AUTH [user] password
//   0x05 LAYER.DROP       str sid, i64 layer (-1: all)       SSM.PREFIX.DROP sid [layer]
//   0x20 ATTEND.CREATE    str sid, u32 key_dim, u32 value_dim, u32 m (0: default),
//                         u32 ef_construction (0: default), u8 metric (0 ip, 1 l2, 2 cos)
//   0x21 ATTEND.STORE     str sid, i64 start_pos (-1: continue), u64 keys_len, keys, rest values
//   0x22 ATTEND.FINALIZE  str sid
//   0x23 ATTEND.QUERY     str sid, u32 k, u32 ef (0: default), u8 options (bit 0: ATTEND), rest q
//   0x24 ATTEND.INFO      str sid (empty: the whole server)
//   0x25 ATTEND.DROP      str sid
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/buffer.h"
#include "proto/cmd_args.h"

namespace pion::proto::binary {

enum Command : uint8_t {
  kLayerStore = 0x01,
  kLayerFetch = 0x02,
  kPing = 0x03,
  kAuth = 0x04,
  kLayerDrop = 0x05,
  kAttendCreate = 0x20,
  kAttendStore = 0x21,
  kAttendFinalize = 0x22,
  kAttendQuery = 0x23,
  kAttendInfo = 0x24,
  kAttendDrop = 0x25,
};

// "LAYER.STORE" for 0x01; empty for a code that is not a command.
std::string_view CommandName(uint8_t code);

// Appends the RESP arguments of one request to *out. The payload's bytes are `payload`;
// `big` is the Buffer that holds them when the payload was large (blob fields then become
// slices of it, read in place) or null (every field is copied). A blob longer than max_blob
// is refused. Returns "" on success, else what is wrong with the payload.
std::string DecodeRequest(uint8_t code, const BufferRef& big, std::string_view payload,
                          uint64_t max_blob, CmdArgs* out);

}  // namespace pion::proto::binary
