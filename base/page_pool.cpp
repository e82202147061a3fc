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

// The whole spans of page_pool::span() inside [first, last).
std::pair<uintptr_t, uintptr_t> whole_spans(uintptr_t first, uintptr_t last) {
  const uintptr_t s = page_pool::span();
  const uintptr_t a = (first + s - 1) / s * s, b = last / s * s;
  return {a, std::max(a, b)};
}

void to_kernel(uintptr_t first, uintptr_t last) {
  if (first < last) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

// A PROT_NONE reservation of n bytes starting at a multiple of span().
uintptr_t reserve_aligned(size_t n) {
  const uintptr_t s = page_pool::span();
  void* r = ::mmap(nullptr, n + s, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return 0;
  const auto base = reinterpret_cast<uintptr_t>(r), at = (base + s - 1) / s * s;
  if (at > base) ::munmap(r, at - base);
  if (base + n + s > at + n) ::munmap(reinterpret_cast<void*>(at + n), base + n + s - (at + n));
  return at;
}

}  // namespace

uintptr_t page_pool::span() {
  // What one page of page tables maps: 2 MiB with 4 KiB pages on x86-64.
  static const uintptr_t s = page_size() * (page_size() / sizeof(void*));
  return s;
}

page_pool::~page_pool() {
  for (const auto& c : chunks_) ::munmap(reinterpret_cast<void*>(c.at), c.bytes);
}

void page_pool::give(void* p, size_t bytes) {
  const auto [first, last] = whole_pages(p, bytes);
  const auto [a, b] = whole_spans(first, last);
  const size_t n = b - a;
  if (n == 0 || pooled_ + n > cap_) return to_kernel(first, last);
  to_kernel(first, a);
  to_kernel(b, last);
  // A place of its own to move them to (the kernel's own choice of one
  // is refused with MREMAP_DONTUNMAP by some kernels), span-aligned as they
  // are, so that whole page tables move.
  const uintptr_t to = reserve_aligned(n);
  if (to != 0) {
    if (::mremap(reinterpret_cast<void*>(a), n, n, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, reinterpret_cast<void*>(to)) != MAP_FAILED) {
      chunks_.push_back({to, n});
      pooled_ += n;
      return;
    }
    ::munmap(reinterpret_cast<void*>(to), n);
  }
  to_kernel(a, b);
}

void page_pool::take(void* p, size_t bytes) {
  const auto [first, last] = whole_pages(p, bytes);
  auto [at, end] = whole_spans(first, last);
  while (at < end && !chunks_.empty()) {
    chunk& c = chunks_.back();
    const size_t n = std::min(c.bytes, end - at);
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
