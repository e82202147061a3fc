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

namespace dtactor {
namespace {

const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));

struct region {
  explicit region(size_t pages) : bytes(pages * page) {
    p = static_cast<char*>(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  }
  ~region() { ::munmap(p, bytes); }
  size_t resident() const {
    std::vector<unsigned char> v(bytes / page);
    if (::mincore(p, bytes, v.data()) != 0) return SIZE_MAX;
    size_t n = 0;
    for (auto c : v) n += c & 1;
    return n;
  }
  char* p;
  size_t bytes;
};

long minor_faults() {
  struct rusage u {};
  ::getrusage(RUSAGE_THREAD, &u);
  return u.ru_minflt;
}

TEST(PagePool, GivenPagesReadAsZerosAndTakenOnesAreWrittenWithoutAFault) {
  const size_t pages = 256;
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
  region a(64), b(64), c(64);
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
  EXPECT_EQ(c.p[0], 3);
  EXPECT_EQ(c.p[c.bytes - 1], 3);
  EXPECT_EQ(c.p[page], 0);
  region d(128);
  pool.take(d.p, d.bytes);
  EXPECT_EQ(pool.pooled_bytes(), 0u);
  EXPECT_EQ(d.resident(), 64u) << "the pool held 64 pages";
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
