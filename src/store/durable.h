// Durable: what an object that SAVE keeps whole on disk tracks about its saves — a STATE slot,
// an SSM session (families/keyed_saved.h saves and reloads both the same way). `writes` counts
// the object's changes; a save records the count it was taken at, so the object is dirty (the
// disk does not hold what memory does) until a save of its current content completes. A new
// incarnation per object of a name tells a save's completion that the object it saved was
// removed (and perhaps made again) meanwhile. Runs on the owning shard.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "residency/disk_file.h"

namespace pion::store {

struct Durable {
  uint64_t incarnation = 0;  // new for every object of this name (a save racing a removal)
  uint64_t writes = 0;       // changes so far
  std::shared_ptr<residency::DiskFile> saved;  // the newest completed save, if any
  uint64_t saved_version = 0;                  // its version; 0: never saved
  uint64_t saved_writes = 0;                   // `writes` when that save was taken

  bool dirty() const { return saved_version == 0 || writes != saved_writes; }
  // Records `file` (of `version`, taken at `writes_then`) as the object's save, unless a newer
  // one completed first.
  void NoteSaved(std::shared_ptr<residency::DiskFile> file, uint64_t version,
                 uint64_t writes_then) {
    if (version <= saved_version) return;
    saved = std::move(file);
    saved_version = version;
    saved_writes = writes_then;
  }
};

}  // namespace pion::store
