#pragma once
// Pages given back and taken again without the kernel zeroing them.
//
// train.zero = 3 gives back the pages of each unit's parameters a rank does
// not hold once the unit has run (rank/zero3) and gathers them again
// before its next use. After madvise(MADV_DONTNEED) every gather writes
// into fresh pages: a fault and a page of zeros before each page's bytes,
// which here runs at about a third of the speed of writing pages already
// present. A pool keeps the pages instead:
//
// - give() moves a range's whole pages into the pool (mremap with
//   MREMAP_DONTUNMAP, Linux 5.7: page tables moved, no copy) and leaves the range
//   mapped as fresh untouched memory, so it reads as zeros and holds no
//   page, as after MADV_DONTNEED;
// - take() moves pooled pages into a range about to be written, so the
//   writes find them present. What they hold before is undefined: the
//   caller overwrites every byte of the range.
//
// The pool keeps at most `cap` bytes; past that give() hands pages back
// to the kernel (MADV_DONTNEED), as it does wherever mremap fails. Only
// for ranges of private anonymous mappings (never the heap, the stack or a
// file): private_anonymous_ranges() tells which. Not thread-safe.
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace dtactor {

class page_pool {
 public:
  explicit page_pool(size_t cap_bytes) : cap_(cap_bytes) {}
  ~page_pool();
  page_pool(const page_pool&) = delete;
  page_pool& operator=(const page_pool&) = delete;

  // The whole pages inside [p, p + bytes): into the pool, or to the kernel.
  void give(void* p, size_t bytes);
  // The whole pages inside [p, p + bytes), front first: replaced by pooled
  // pages, as many as the pool holds.
  void take(void* p, size_t bytes);
  size_t pooled_bytes() const { return pooled_; }
  size_t cap() const { return cap_; }

 private:
  struct chunk {
    uintptr_t at = 0;
    size_t bytes = 0;
  };
  std::vector<chunk> chunks_;
  size_t pooled_ = 0;
  size_t cap_;
};

// This process's private anonymous mappings (no file, not the heap nor a
// stack), adjacent ones joined, from /proc/self/maps; and whether
// [p, p + bytes) lies inside one of them.
class private_anonymous_ranges {
 public:
  private_anonymous_ranges();
  bool cover(const void* p, size_t bytes) const;

 private:
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges_;
};

}  // namespace dtactor
