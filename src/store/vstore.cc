#include "store/vstore.h"

namespace pion::store {
namespace {

std::string Describe(const codec::RowCodec& c) {
  std::string s =
      "dim " + std::to_string(c.dim()) + " format " + std::string(FormatName(c.format()));
  if (c.block() != 0) s += " block " + std::to_string(c.block());
  return s;
}

}  // namespace

Status VStore::Create(const TenantKey& key, const codec::RowCodec& codec) {
  auto it = sessions_.find(key);
  if (it != sessions_.end()) {
    const auto& have = it->second.session->codec();
    if (have.dim() == codec.dim() && have.format() == codec.format() &&
        have.block() == codec.block()) {
      return Status::Ok();
    }
    return Error("session '" + key.name + "' exists with " + Describe(have) + ", not " +
                 Describe(codec) + "; V.DROP it first");
  }
  Entry e;
  e.session = std::make_unique<VSession>(
      codec, engine_, allocator_for_ ? allocator_for_(key.tenant) : BufferAllocator::Default());
  // Snapshot ids continue above the sealed ones (they survive restarts).
  auto sealed = sealed_.find(key);
  if (sealed != sealed_.end() && !sealed->second.empty()) {
    e.next_snapshot = sealed->second.rbegin()->first + 1;
  }
  sessions_.emplace(key, std::move(e));
  sessions_gauge_.store(sessions_.size(), std::memory_order_relaxed);
  return Status::Ok();
}

bool VStore::Entry::Shaped::AskAgain(int64_t start, int64_t end) {
  const auto first = static_cast<size_t>(start / kRowsPerChunk);
  const auto last = static_cast<size_t>((end - 1) / kRowsPerChunk);
  if (asked.size() <= last) asked.resize(last + 1, false);
  bool again = true;
  for (size_t c = first; c <= last; ++c) {
    again = again && asked[c];
    asked[c] = true;
  }
  return again;
}

VStore::Entry::Shaped* VStore::ShapedOf(const TenantKey& key, const codec::RowView& shape) {
  Entry* e = Find(key);
  if (e == nullptr || shape.output() == codec::RowView::Output::kFp32) return nullptr;
  const codec::RowCodec& codec = shape.out_codec();
  Entry::Shaped& t = e->shaped[{codec.format(), shape.first(), shape.count()}];
  if (t.session == nullptr || t.writes != e->writes || t.session->dim() != codec.dim()) {
    t.session = std::make_unique<VSession>(
        codec, engine_, allocator_for_ ? allocator_for_(key.tenant) : BufferAllocator::Default());
    t.writes = e->writes;
    t.asked.clear();
  }
  return &t;
}

VStore::Entry* VStore::Find(const TenantKey& key) {
  auto it = sessions_.find(key);
  return it == sessions_.end() ? nullptr : &it->second;
}

StatusOr<VStore::Entry*> VStore::Get(const TenantKey& key) {
  Entry* e = Find(key);
  if (e == nullptr) return Error("no such session '" + key.name + "'");
  return e;
}

bool VStore::Drop(const TenantKey& key) {
  auto it = sessions_.find(key);
  if (it == sessions_.end()) return false;
  NoteRows(-static_cast<int64_t>(it->second.session->rows()));
  sessions_.erase(it);  // chunks still referenced by replies in flight are freed after them
  sessions_gauge_.store(sessions_.size(), std::memory_order_relaxed);
  return true;
}

const VStore::Sealed* VStore::FindSealed(const TenantKey& key, uint64_t snapshot) const {
  auto it = sealed_.find(key);
  if (it == sealed_.end()) return nullptr;
  auto s = it->second.find(snapshot);
  return s == it->second.end() ? nullptr : &s->second;
}

size_t VStore::SealedCount(const TenantKey& key) const {
  auto it = sealed_.find(key);
  return it == sealed_.end() ? 0 : it->second.size();
}

std::vector<std::string> VStore::TakeSealed(const TenantKey& key) {
  std::vector<std::string> paths;
  auto it = sealed_.find(key);
  if (it == sealed_.end()) return paths;
  for (auto& [id, s] : it->second) paths.push_back(s.path);
  sealed_.erase(it);
  return paths;
}

std::string VStore::TakeSealed(const TenantKey& key, uint64_t snapshot) {
  auto it = sealed_.find(key);
  if (it == sealed_.end()) return "";
  auto s = it->second.find(snapshot);
  if (s == it->second.end()) return "";
  std::string path = s->second.path;
  it->second.erase(s);
  if (it->second.empty()) sealed_.erase(it);
  return path;
}

VStore::Usage VStore::UsageOf(uint32_t tenant) const {
  Usage u;
  for (const auto& [k, e] : sessions_) {
    if (k.tenant != tenant) continue;
    ++u.sessions;
    u.rows += e.session->rows();
    u.snapshots += e.snapshots.size();
  }
  return u;
}

}  // namespace pion::store
