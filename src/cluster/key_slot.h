// Redis Cluster's key → hash slot: CRC16 (XMODEM) of the key, or of its hash tag — the bytes
// between the first '{' and the first '}' after it, when that is not empty — modulo 16384.
// Clients compute the same function, so it must match Redis bit for bit.
#pragma once

#include <cstdint>
#include <string_view>

namespace pion::cluster {

inline constexpr int kSlots = 16384;

// CRC16/XMODEM (polynomial 0x1021, initial 0), as Redis' crc16.c.
uint16_t Crc16(std::string_view bytes);

// The part of `key` that is hashed: its hash tag, or the whole key.
std::string_view HashTagOf(std::string_view key);

// The hash slot of `key`, in [0, 16384).
int KeySlot(std::string_view key);

}  // namespace pion::cluster
