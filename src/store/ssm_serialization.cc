#include "store/ssm_serialization.h"

#include <cstring>

namespace pion::store {
namespace {

void PutU32(std::string* out, uint32_t v) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out->append(b, 4);
}

bool GetU32(std::string_view blob, size_t* off, uint32_t* v) {
  if (blob.size() - *off < 4) return false;
  *v = 0;
  for (int i = 0; i < 4; ++i) {
    *v |= static_cast<uint32_t>(static_cast<uint8_t>(blob[*off + i])) << (8 * i);
  }
  *off += 4;
  return true;
}

}  // namespace

std::string SerializeSsmState(const std::vector<SsmArray>& arrays) {
  std::string out;
  PutU32(&out, 1);
  PutU32(&out, static_cast<uint32_t>(arrays.size()));
  for (const auto& a : arrays) {
    PutU32(&out, static_cast<uint32_t>(a.shape.size()));
    for (uint32_t d : a.shape) PutU32(&out, d);
    PutU32(&out, a.dtype_code);
    for (float f : a.values) {
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      PutU32(&out, bits);
    }
  }
  return out;
}

StatusOr<std::vector<SsmArray>> ParseSsmState(std::string_view blob) {
  size_t off = 0;
  uint32_t version = 0, n = 0;
  if (!GetU32(blob, &off, &version) || !GetU32(blob, &off, &n)) {
    return Error("SSM state blob shorter than its 8-byte header");
  }
  if (version != 1) return Error("SSM state version " + std::to_string(version) + ", expected 1");
  std::vector<SsmArray> arrays;
  for (uint32_t a = 0; a < n; ++a) {
    SsmArray arr;
    uint32_t ndim = 0;
    if (!GetU32(blob, &off, &ndim) || ndim > 16) {
      return Error("array " + std::to_string(a) + ": bad ndim at offset " + std::to_string(off));
    }
    uint64_t count = 1;
    for (uint32_t d = 0; d < ndim; ++d) {
      uint32_t dim = 0;
      if (!GetU32(blob, &off, &dim))
        return Error("array " + std::to_string(a) + ": truncated shape");
      arr.shape.push_back(dim);
      count *= dim;
    }
    if (!GetU32(blob, &off, &arr.dtype_code) || arr.dtype_code > 2) {
      return Error("array " + std::to_string(a) + ": dtype_code must be 0, 1 or 2");
    }
    if (count > (blob.size() - off) / 4) {
      return Error("array " + std::to_string(a) + ": needs " + std::to_string(count * 4) +
                   " bytes at offset " + std::to_string(off) + ", blob has " +
                   std::to_string(blob.size() - off));
    }
    arr.values.resize(count);
    if (count > 0) std::memcpy(arr.values.data(), blob.data() + off, count * 4);  // (a 0 dim)
    off += count * 4;
    arrays.push_back(std::move(arr));
  }
  if (off != blob.size()) {
    return Error("SSM state blob has " + std::to_string(blob.size() - off) + " trailing bytes");
  }
  return arrays;
}

}  // namespace pion::store
