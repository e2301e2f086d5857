#include "store/disk/object_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>

#include "common/faults.h"

namespace pion::store::disk {
namespace {

constexpr char kMagic[8] = {'P', 'I', 'O', 'N', 'O', 'B', 'J', '1'};
constexpr char kEndMagic[8] = {'P', 'I', 'O', 'N', 'E', 'N', 'D', '1'};
constexpr uint32_t kFormat = 1;
constexpr const char* kSuffix = ".pobj";

Status IoError(const std::string& what, const std::string& path) {
  return Status(ErrorKind::kIo, what + " " + path + ": " + std::strerror(errno));
}

void Put64(std::string* s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void Put32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t Get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}
uint32_t Get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}

std::string HexName(std::string_view name) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : name) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

bool UnHexName(std::string_view hex, std::string* out) {
  if (hex.size() % 2 != 0) return false;
  auto val = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  out->clear();
  for (size_t i = 0; i < hex.size(); i += 2) {
    int hi = val(hex[i]), lo = val(hex[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi * 16 + lo));
  }
  return true;
}

// The last component of a directory path: what a fault-injection rule targets.
std::string_view TargetOf(std::string_view dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.remove_suffix(1);
  auto slash = dir.rfind('/');
  return slash == std::string_view::npos ? dir : dir.substr(slash + 1);
}

std::string_view TargetOfFile(std::string_view path) {
  auto slash = path.rfind('/');
  return slash == std::string_view::npos ? std::string_view() : TargetOf(path.substr(0, slash));
}

Status WriteAll(int fd, const void* data, size_t len, const std::string& path,
                std::string_view target) {
  const auto* p = static_cast<const uint8_t*>(data);
  const faults::Fault f = faults::CheckAndDelay(faults::Point::kDiskWrite, target);
  if (f.action == faults::Action::kError || f.action == faults::Action::kNoSpace) {
    errno = f.action == faults::Action::kError ? EIO : ENOSPC;
    return IoError("cannot write", path);
  }
  if (f.action == faults::Action::kShort) {
    len /= 2;  // the device takes half, then fails
    while (len > 0) {
      ssize_t n = write(fd, p, len);
      if (n <= 0) break;
      p += n;
      len -= static_cast<size_t>(n);
    }
    errno = EIO;
    return IoError("short write to", path);
  }
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return IoError("cannot write", path);
    p += n;
    len -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status ReadAt(int fd, void* out, size_t len, uint64_t off, const std::string& path) {
  auto* p = static_cast<uint8_t*>(out);
  while (len > 0) {
    ssize_t n = pread(fd, p, len, static_cast<off_t>(off));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError("cannot read", path);
    if (n == 0) return Status(ErrorKind::kCorrupt, path + " is truncated");
    p += n;
    len -= static_cast<size_t>(n);
    off += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

// fsync(2) through the fault-injection point.
int CheckedFsync(int fd, std::string_view target) {
  const faults::Fault f = faults::CheckAndDelay(faults::Point::kDiskFsync, target);
  if (f.action != faults::Action::kNone) {
    errno = f.action == faults::Action::kNoSpace ? ENOSPC : EIO;
    return -1;
  }
  return fsync(fd);
}

Status FsyncDir(const std::string& dir) {
  int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError("cannot open directory", dir);
  int rc = CheckedFsync(fd, TargetOf(dir));
  close(fd);
  if (rc != 0) return IoError("cannot fsync directory", dir);
  return Status::Ok();
}

Status EnsureDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);  // like mkdir -p: --dir may not exist yet
  if (ec) return Status(ErrorKind::kIo, "cannot create directory " + dir + ": " + ec.message());
  return Status::Ok();
}

// Parses "<hex>.<version>.pobj".
bool ParseFileName(const std::string& file, std::string* name, uint64_t* version) {
  if (file.size() <= std::strlen(kSuffix) || !file.ends_with(kSuffix)) return false;
  std::string stem = file.substr(0, file.size() - std::strlen(kSuffix));
  auto dot = stem.rfind('.');
  if (dot == std::string::npos) return false;
  char* end = nullptr;
  std::string v = stem.substr(dot + 1);
  *version = std::strtoull(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0') return false;
  return UnHexName(std::string_view(stem).substr(0, dot), name);
}

}  // namespace

bool IsNoSpace(const Status& s) {
  // IoError ends every message with strerror(errno).
  if (s.kind() != ErrorKind::kIo) return false;
  for (int e : {ENOSPC, EDQUOT}) {
    if (s.message().ends_with(std::strerror(e))) return true;
  }
  return false;
}

std::string ObjectPath(const std::string& dir, std::string_view name, uint64_t version) {
  return dir + "/" + HexName(name) + "." + std::to_string(version) + kSuffix;
}

uint64_t ObjectFileBytes(std::string_view meta,
                         const std::vector<std::span<const uint8_t>>& blocks) {
  uint64_t n = 28 + meta.size() + 16 * blocks.size() + 8 + 8;
  for (const auto& b : blocks) n += b.size();
  return n;
}

Status WriteObject(const std::string& dir, std::string_view name, uint64_t version,
                   std::string_view meta, const std::vector<std::span<const uint8_t>>& blocks,
                   WriteOptions options) {
  std::vector<BlockSource> sources(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    sources[i].length = blocks[i].size();
    sources[i].data = blocks[i].data();
  }
  return WriteObjectFrom(dir, name, version, meta, sources, options);
}

Status WriteObjectFrom(const std::string& dir, std::string_view name, uint64_t version,
                       std::string_view meta, const std::vector<BlockSource>& blocks,
                       WriteOptions options) {
  Status s = EnsureDir(dir);
  if (!s.ok()) return s;
  const std::string_view target = TargetOf(dir);
  const std::string base = dir + "/" + HexName(name) + "." + std::to_string(version);
  const std::string final_path = base + kSuffix;
  const std::string tmp_path = base + ".tmp";

  std::string head(kMagic, 8);
  Put32(&head, kFormat);
  Put64(&head, version);
  Put32(&head, static_cast<uint32_t>(meta.size()));
  Put32(&head, static_cast<uint32_t>(blocks.size()));
  head.append(meta);
  for (const auto& b : blocks) {
    Put64(&head, b.length);
    Put64(&head, b.hashed ? b.hash : XXH3_64bits(b.data, b.length));
  }
  Put64(&head, XXH3_64bits(head.data(), head.size()));

  int fd = open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError("cannot create", tmp_path);
  s = WriteAll(fd, head.data(), head.size(), tmp_path, target);
  std::vector<uint8_t> scratch;
  for (size_t i = 0; s.ok() && i < blocks.size(); ++i) {
    const uint8_t* p = blocks[i].data;
    if (p == nullptr && blocks[i].length > 0) {
      scratch.resize(blocks[i].length);
      s = blocks[i].read(scratch.data());
      p = scratch.data();
    }
    if (s.ok()) s = WriteAll(fd, p, blocks[i].length, tmp_path, target);
  }
  if (s.ok()) s = WriteAll(fd, kEndMagic, 8, tmp_path, target);
  if (s.ok() && options.durable && CheckedFsync(fd, target) != 0) {
    s = IoError("cannot fsync", tmp_path);
  }
  close(fd);
  if (s.ok() && rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    s = IoError("cannot rename into", final_path);
  }
  if (s.ok() && options.durable) s = FsyncDir(dir);
  if (!s.ok()) {
    unlink(tmp_path.c_str());
    unlink(final_path.c_str());  // renamed but not durable: never report it as saved
    return s;
  }
  if (!options.remove_older) return Status::Ok();
  // The new version is durable: older versions may go now.
  DIR* d = opendir(dir.c_str());
  if (d != nullptr) {
    while (dirent* e = readdir(d)) {
      std::string n;
      uint64_t v = 0;
      if (ParseFileName(e->d_name, &n, &v) && n == name && v < version) {
        unlink((dir + "/" + e->d_name).c_str());
      }
    }
    closedir(d);
  }
  return Status::Ok();
}

Status WriteObjectBytes(const std::string& dir, std::string_view name, uint64_t version,
                        std::string_view bytes) {
  Status s = EnsureDir(dir);
  if (!s.ok()) return s;
  const std::string_view target = TargetOf(dir);
  const std::string base = dir + "/" + HexName(name) + "." + std::to_string(version);
  const std::string final_path = base + kSuffix;
  const std::string tmp_path = base + ".tmp";
  int fd = open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError("cannot create", tmp_path);
  s = WriteAll(fd, bytes.data(), bytes.size(), tmp_path, target);
  if (s.ok() && CheckedFsync(fd, target) != 0) s = IoError("cannot fsync", tmp_path);
  close(fd);
  if (s.ok() && rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    s = IoError("cannot rename into", final_path);
  }
  if (s.ok()) s = FsyncDir(dir);
  if (!s.ok()) {
    unlink(tmp_path.c_str());
    unlink(final_path.c_str());
  }
  return s;
}

ObjectFile::ObjectFile(ObjectFile&& o) noexcept
    : path_(std::move(o.path_)),
      target_(std::move(o.target_)),
      fd_(o.fd_),
      version_(o.version_),
      file_bytes_(o.file_bytes_),
      meta_(std::move(o.meta_)),
      blocks_(std::move(o.blocks_)) {
  o.fd_ = -1;
}

ObjectFile& ObjectFile::operator=(ObjectFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) close(fd_);
    path_ = std::move(o.path_);
    target_ = std::move(o.target_);
    fd_ = o.fd_;
    version_ = o.version_;
    file_bytes_ = o.file_bytes_;
    meta_ = std::move(o.meta_);
    blocks_ = std::move(o.blocks_);
    o.fd_ = -1;
  }
  return *this;
}

ObjectFile::~ObjectFile() {
  if (fd_ >= 0) close(fd_);
}

uint64_t ObjectFile::data_bytes() const {
  uint64_t n = 0;
  for (const auto& b : blocks_) n += b.length;
  return n;
}

StatusOr<ObjectFile> ObjectFile::Open(const std::string& path, bool writable) {
  ObjectFile f;
  f.path_ = path;
  f.target_ = std::string(TargetOfFile(path));
  f.fd_ = open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (f.fd_ < 0) return IoError("cannot open", path);
  struct stat st {};
  if (fstat(f.fd_, &st) != 0) return IoError("cannot stat", path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  f.file_bytes_ = size;
  uint8_t fixed[28];
  if (size < sizeof(fixed) + 16) return Status(ErrorKind::kCorrupt, path + " is truncated");
  Status s = ReadAt(f.fd_, fixed, sizeof(fixed), 0, path);
  if (!s.ok()) return s;
  if (std::memcmp(fixed, kMagic, 8) != 0) {
    return Status(ErrorKind::kCorrupt, path + " is not a Pion object file");
  }
  if (Get32(fixed + 8) != kFormat) {
    return Status(ErrorKind::kCorrupt,
                  path + " has unknown format " + std::to_string(Get32(fixed + 8)));
  }
  f.version_ = Get64(fixed + 12);
  const uint32_t meta_len = Get32(fixed + 20), n_blocks = Get32(fixed + 24);
  const uint64_t head_len = sizeof(fixed) + uint64_t{meta_len} + 16ull * n_blocks;
  if (head_len + 8 + 8 > size) return Status(ErrorKind::kCorrupt, path + " is truncated");
  std::string head(head_len + 8, '\0');
  s = ReadAt(f.fd_, head.data(), head.size(), 0, path);
  if (!s.ok()) return s;
  const auto* h = reinterpret_cast<const uint8_t*>(head.data());
  if (XXH3_64bits(h, head_len) != Get64(h + head_len)) {
    return Status(ErrorKind::kCorrupt, path + ": header checksum mismatch");
  }
  f.meta_.assign(head.data() + sizeof(fixed), meta_len);
  uint64_t off = head_len + 8;
  for (uint32_t i = 0; i < n_blocks; ++i) {
    const uint8_t* e = h + sizeof(fixed) + meta_len + 16ull * i;
    f.blocks_.push_back(Block{Get64(e), Get64(e + 8), off});
    off += Get64(e);
  }
  if (off + 8 != size) {
    return Status(ErrorKind::kCorrupt, path + " has " + std::to_string(size) + " bytes, expected " +
                                           std::to_string(off + 8) + " (truncated or torn)");
  }
  char end[8];
  s = ReadAt(f.fd_, end, 8, off, path);
  if (!s.ok()) return s;
  if (std::memcmp(end, kEndMagic, 8) != 0) {
    return Status(ErrorKind::kCorrupt, path + ": end marker missing (torn write)");
  }
  return f;
}

Status ObjectFile::ReadBlock(size_t i, uint8_t* out) const {
  const Block& b = blocks_[i];
  for (int attempt = 0;; ++attempt) {
    const faults::Fault f = faults::CheckAndDelay(faults::Point::kDiskRead, target_);
    if (f.action == faults::Action::kError || f.action == faults::Action::kNoSpace) {
      errno = EIO;
      return IoError("cannot read", path_);
    }
    Status s = ReadAt(fd_, out, b.length, b.offset, path_);
    if (!s.ok()) return s;
    if (f.action == faults::Action::kCorrupt && b.length > 0) out[b.length / 2] ^= 0x5a;
    if (XXH3_64bits(out, b.length) == b.hash) return Status::Ok();
    if (attempt == 1) {
      return Status(ErrorKind::kCorrupt,
                    path_ + ": block " + std::to_string(i) + " checksum mismatch");
    }
  }
}

Status ObjectFile::PunchBlock(size_t i) const {
  const Block& b = blocks_[i];
  if (b.length == 0) return Status::Ok();
  if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(b.offset),
                static_cast<off_t>(b.length)) != 0) {
    return IoError("cannot punch a hole in", path_);
  }
  return Status::Ok();
}

StatusOr<std::vector<ListedObject>> ListObjects(const std::string& dir) {
  Status s = EnsureDir(dir);
  if (!s.ok()) return s;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return IoError("cannot list", dir);
  std::map<std::string, ListedObject> newest;
  while (dirent* e = readdir(d)) {
    std::string file = e->d_name;
    std::string name;
    uint64_t version = 0;
    if (!ParseFileName(file, &name, &version)) continue;
    auto it = newest.find(name);
    if (it == newest.end() || it->second.version < version) {
      newest[name] = ListedObject{name, version, dir + "/" + file};
    }
  }
  closedir(d);
  std::vector<ListedObject> out;
  for (auto& [n, o] : newest) out.push_back(std::move(o));
  return out;
}

Status RemoveLeftoverTemps(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return errno == ENOENT ? Status::Ok() : IoError("cannot list", dir);
  while (dirent* e = readdir(d)) {
    std::string file = e->d_name;
    if (file.ends_with(".tmp")) unlink((dir + "/" + file).c_str());
  }
  closedir(d);
  return Status::Ok();
}

Status RemoveFiles(const std::string& dir, const std::vector<std::string>& paths) {
  for (const auto& p : paths) {
    if (unlink(p.c_str()) != 0 && errno != ENOENT) return IoError("cannot remove", p);
  }
  return FsyncDir(dir);
}

Status RemoveObject(const std::string& dir, std::string_view name) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return errno == ENOENT ? Status::Ok() : IoError("cannot list", dir);
  while (dirent* e = readdir(d)) {
    std::string n;
    uint64_t v = 0;
    if (ParseFileName(e->d_name, &n, &v) && n == name) unlink((dir + "/" + e->d_name).c_str());
  }
  closedir(d);
  return FsyncDir(dir);
}

}  // namespace pion::store::disk
