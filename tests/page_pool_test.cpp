// base/page_pool: pages given back read as zeros and hold no memory; taken
// again into a range about to be written, they are present there (no page
// fault writing them); the cap bounds what the pool keeps; only private
// anonymous mappings are covered.
#include "base/page_pool.hpp"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace dtactor {
namespace {

const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));

const size_t span = page_pool::span();

// `pages` pages, starting at a multiple of the pool's span.
struct region {
  explicit region(size_t pages) : bytes(pages * page) {
    raw = static_cast<char*>(::mmap(nullptr, bytes + span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    p = raw == MAP_FAILED ? raw : reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + span - 1) / span * span);
  }
  ~region() { ::munmap(raw, bytes + span); }
  size_t resident() const {
    std::vector<unsigned char> v(bytes / page);
    if (::mincore(p, bytes, v.data()) != 0) return SIZE_MAX;
    size_t n = 0;
    for (auto c : v) n += c & 1;
    return n;
  }
  char* raw;
  char* p;
  size_t bytes;
};

const size_t span_pages = span / page;

long minor_faults() {
  struct rusage u {};
  ::getrusage(RUSAGE_THREAD, &u);
  return u.ru_minflt;
}

TEST(PagePool, GivenPagesReadAsZerosAndTakenOnesAreWrittenWithoutAFault) {
  const size_t pages = 2 * span_pages;
  region a(pages), b(pages), control(pages);
  ASSERT_NE(a.p, MAP_FAILED);
  std::memset(a.p, 7, a.bytes);
  ASSERT_EQ(a.resident(), pages);
  page_pool pool(2 * a.bytes);
  pool.give(a.p, a.bytes);
  EXPECT_EQ(pool.pooled_bytes(), a.bytes);
  EXPECT_EQ(a.resident(), 0u) << "given pages must leave the range";
  for (size_t i = 0; i < a.bytes; i += page) ASSERT_EQ(a.p[i], 0) << "a given range reads as zeros";

  pool.take(b.p, b.bytes);
  EXPECT_EQ(pool.pooled_bytes(), 0u);
  EXPECT_EQ(b.resident(), pages) << "taken pages are present before any write";
  long before = minor_faults();
  std::memset(b.p, 9, b.bytes);
  const long with_pool = minor_faults() - before;
  before = minor_faults();
  std::memset(control.p, 9, control.bytes);
  const long without = minor_faults() - before;
  EXPECT_LT(with_pool, 8) << "writing taken pages faulted";
  EXPECT_GE(without, static_cast<long>(pages) / 2) << "the control must fault, or this test measures nothing";
  for (size_t i = 0; i < b.bytes; i += page) ASSERT_EQ(b.p[i], 9);
}

// Past the cap, pages go back to the kernel; a partial page at either end
// of a range stays where it is; a take moves what the pool holds, no more.
TEST(PagePool, TheCapBoundsThePoolAndOnlyWholePagesMove) {
  region a(span_pages), b(span_pages), c(span_pages);
  std::memset(a.p, 1, a.bytes);
  std::memset(b.p, 2, b.bytes);
  page_pool pool(a.bytes);
  pool.give(a.p, a.bytes);
  pool.give(b.p, b.bytes);
  EXPECT_EQ(pool.pooled_bytes(), a.bytes);
  EXPECT_EQ(b.resident(), 0u) << "past the cap the pages are given back all the same";
  EXPECT_EQ(b.p[0], 0);
  std::memset(c.p, 3, c.bytes);
  pool.give(c.p + 10, c.bytes - 20);  // the first and last pages are partial
  EXPECT_EQ(c.resident(), 2u) << "the partial pages stay, the whole ones go to the kernel (c has no whole span)";
  EXPECT_EQ(c.p[0], 3);
  EXPECT_EQ(c.p[c.bytes - 1], 3);
  EXPECT_EQ(c.p[page], 0);
  EXPECT_EQ(pool.pooled_bytes(), a.bytes);
  region d(2 * span_pages);
  pool.take(d.p, d.bytes);
  EXPECT_EQ(pool.pooled_bytes(), 0u);
  EXPECT_EQ(d.resident(), span_pages) << "the pool held one span";
}

// Only whole page-table spans are pooled, and taken into whole spans, so
// that every page keeps its offset within a span (mremap moves whole page
// tables); the rest of a range's pages go to the kernel and read as zeros.
TEST(PagePool, OnlyWholeSpansArePooledAndTakenAtTheirOffset) {
  region e(3 * span_pages), f(3 * span_pages);
  std::memset(e.p, 4, e.bytes);
  page_pool pool(3 * span);
  pool.give(e.p + page, e.bytes - page);  // spans 1 and 2 whole, span 0 less a page
  EXPECT_EQ(pool.pooled_bytes(), 2 * span);
  EXPECT_EQ(e.resident(), 1u) << "span 0's pages but the first go to the kernel";
  for (size_t i = page; i < e.bytes; i += page) ASSERT_EQ(e.p[i], 0);
  pool.take(f.p + 5 * page, 2 * span);  // the one whole span inside
  EXPECT_EQ(pool.pooled_bytes(), span);
  EXPECT_EQ(f.resident(), span_pages);
  std::vector<unsigned char> v(span_pages);
  ASSERT_EQ(::mincore(f.p + span, span, v.data()), 0);
  for (auto c : v) ASSERT_EQ(c & 1, 1) << "taken into f's second span, the first whole one";
}

TEST(PagePool, OnlyPrivateAnonymousMappingsAreCovered) {
  region a(16);
  void* small = std::malloc(3 * page);  // the heap (below malloc's mmap threshold)
  char name[] = "/tmp/page_pool_test_XXXXXX";
  const int fd = ::mkstemp(name);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(16 * page)), 0);
  void* file = ::mmap(nullptr, 16 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  void* shared = ::mmap(nullptr, 16 * page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  const private_anonymous_ranges ranges;
  EXPECT_TRUE(ranges.cover(a.p, a.bytes));
  EXPECT_TRUE(ranges.cover(a.p + 5, 3 * page));
  EXPECT_FALSE(ranges.cover(file, 16 * page));
  EXPECT_FALSE(ranges.cover(shared, 16 * page));
  EXPECT_FALSE(ranges.cover(small, 3 * page)) << "the heap";
  ::munmap(file, 16 * page);
  ::munmap(shared, 16 * page);
  ::close(fd);
  ::unlink(name);
  std::free(small);
}

}  // namespace
}  // namespace dtactor
