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
// - give() moves the whole page-table spans of a range (span(), 2 MiB)
//   into the pool (mremap with MREMAP_DONTUNMAP, Linux 5.7: no copy) and
//   leaves the range mapped as fresh untouched memory, so it reads as
//   zeros and holds no page, as after MADV_DONTNEED; the range's other
//   whole pages go to the kernel;
// - take() moves pooled spans into the whole spans of a range about to be
//   written, so the writes find them present. What they hold before is
//   undefined: the caller overwrites every byte of the range.
//
// Whole spans, because pages moved one by one to another offset within a
// span are rewritten entry by entry in the page tables, and on a virtual
// machine that shadows them (as this project's build machines do) each
// such page then costs about what a fault costs at its next write, which
// is what the pool is there to avoid.
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
  // The unit the pool moves: what one page of page tables maps (2 MiB on
  // x86-64). Only whole spans are pooled, moved to and from places at the
  // same offset within a span, so that mremap moves whole page tables; the
  // pages of a range outside its whole spans go to the kernel.
  static uintptr_t span();
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
