// The reference serialization of recurrent state from seed 002, for clients and tests: the
// server stores SSM.PREFIX blobs opaquely and never parses them.
//
//   uint32 version = 1
//   uint32 n_arrays
//   per array: uint32 ndim, uint32 shape[ndim], uint32 dtype_code, raw bytes
//
// All little-endian. dtype_code 0 = fp32, 1 = fp16, 2 = bf16; per the seed, fp16/bf16 arrays
// are carried as fp32 values (lossless widening), so the raw bytes are always
// 4 * prod(shape).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pion::store {

struct SsmArray {
  std::vector<uint32_t> shape;
  uint32_t dtype_code = 0;    // the original dtype (0 fp32, 1 fp16, 2 bf16)
  std::vector<float> values;  // prod(shape) values
};

std::string SerializeSsmState(const std::vector<SsmArray>& arrays);
// Parses a blob; kErr naming the offset and what was expected on malformed input.
StatusOr<std::vector<SsmArray>> ParseSsmState(std::string_view blob);

}  // namespace pion::store
