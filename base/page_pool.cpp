#include "base/page_pool.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif

namespace dtactor {

namespace {

uintptr_t page_size() {
  static const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// The whole pages inside [p, p + bytes).
std::pair<uintptr_t, uintptr_t> whole_pages(const void* p, size_t bytes) {
  const uintptr_t page = page_size(), a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (a + page - 1) / page * page, last = (a + bytes) / page * page;
  return {first, std::max(first, last)};
}

}  // namespace

page_pool::~page_pool() {
  for (const auto& c : chunks_) ::munmap(reinterpret_cast<void*>(c.at), c.bytes);
}

void page_pool::give(void* p, size_t bytes) {
  const auto [first, last] = whole_pages(p, bytes);
  const size_t n = last - first;
  if (n == 0) return;
  if (pooled_ + n <= cap_) {
    // A place of its own to move them to (the kernel's own choice of one
    // is refused with MREMAP_DONTUNMAP by some kernels).
    void* to = ::mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (to != MAP_FAILED) {
      if (::mremap(reinterpret_cast<void*>(first), n, n, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, to) != MAP_FAILED) {
        chunks_.push_back({reinterpret_cast<uintptr_t>(to), n});
        pooled_ += n;
        return;
      }
      ::munmap(to, n);
    }
  }
  ::madvise(reinterpret_cast<void*>(first), n, MADV_DONTNEED);
}

void page_pool::take(void* p, size_t bytes) {
  auto [at, last] = whole_pages(p, bytes);
  while (at < last && !chunks_.empty()) {
    chunk& c = chunks_.back();
    const size_t n = std::min(c.bytes, last - at);
    if (::mremap(reinterpret_cast<void*>(c.at), n, n, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(at)) == MAP_FAILED) return;
    at += n;
    pooled_ -= n;
    c.at += n;
    c.bytes -= n;
    if (c.bytes == 0) chunks_.pop_back();
  }
}

private_anonymous_ranges::private_anonymous_ranges() {
  std::ifstream in("/proc/self/maps");
  std::string line;
  while (std::getline(in, line)) {
    unsigned long lo = 0, hi = 0, offset = 0, inode = 0;
    char perms[8] = {0}, dev[16] = {0};
    int name_at = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx %7s %lx %15s %lu %n", &lo, &hi, perms, &offset, dev, &inode, &name_at) < 6) continue;
    const bool unnamed = name_at <= 0 || static_cast<size_t>(name_at) >= line.size();
    if (inode != 0 || !unnamed || perms[3] != 'p' || perms[0] != 'r' || perms[1] != 'w') continue;
    if (!ranges_.empty() && ranges_.back().second == lo)
      ranges_.back().second = hi;
    else
      ranges_.emplace_back(lo, hi);
  }
}

bool private_anonymous_ranges::cover(const void* p, size_t bytes) const {
  const auto [first, last] = whole_pages(p, bytes);
  if (first == last) return true;
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), std::make_pair(first, UINTPTR_MAX));
  if (it == ranges_.begin()) return false;
  --it;
  return it->first <= first && last <= it->second;
}

}  // namespace dtactor
