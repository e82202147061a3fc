// A lock held by a live process is errc::busy, and the two places that act
// on it (the run directory's message, a node id's claim) decide by that
// code, never by the message's text.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "app/cluster_util.hpp"
#include "storage/fs.hpp"
#include "test_util.hpp"

using namespace dtactor;

TEST(FileLock, AHeldLockIsBusyAndNamesItsHolder) {
  dtactor::testing::temp_dir d;
  const std::string path = d.path() + "/x.lock";
  auto first = file_lock::try_acquire(path, "the first");
  ASSERT_TRUE(first) << first.message();
  // flock is per open file: a second open in this process is refused too.
  auto second = file_lock::try_acquire(path, "the second");
  ASSERT_FALSE(second);
  EXPECT_EQ(second.code(), errc::busy);
  EXPECT_EQ(second.message(), "pid " + std::to_string(::getpid()) + " (the first)");
  EXPECT_EQ(run_dir_busy_message(d.path(), second.err()),
            "run directory '" + d.path() + "' is in use by another dtactor (pid " + std::to_string(::getpid()) +
                " (the first)); wait for it to end, stop it, or choose another --run-dir");
}

TEST(FileLock, ALockThatCannotBeOpenedIsNotBusy) {
  dtactor::testing::temp_dir d;
  auto l = file_lock::try_acquire(d.path() + "/no/such/dir/x.lock", "me");
  ASSERT_FALSE(l);
  EXPECT_NE(l.code(), errc::busy);
  const std::string msg = run_dir_busy_message(d.path(), l.err());
  EXPECT_EQ(msg.rfind("run directory '" + d.path() + "': cannot open", 0), 0u) << msg;
}

TEST(ClaimNodeId, ATakenIdIsRefusedOrReplacedByTheLockCode) {
  const std::string coordinator = "tcp://lock-test-" + std::to_string(::getpid()) + ":1";
  auto a = claim_node_id("n", true, coordinator);
  ASSERT_TRUE(a) << a.message();
  EXPECT_EQ(a->id, "n");
  EXPECT_TRUE(a->lock.held());
  // An explicit id held by a live node of the job: refused, naming the holder.
  auto b = claim_node_id("n", true, coordinator);
  ASSERT_FALSE(b);
  EXPECT_NE(b.message().find("node id 'n' is already used by another node of this job on this machine (held by pid " +
                             std::to_string(::getpid())),
            std::string::npos)
      << b.message();
  // The default id falls back to the next free one.
  auto c = claim_node_id("n", false, coordinator);
  ASSERT_TRUE(c) << c.message();
  EXPECT_EQ(c->id, "n-2");
  EXPECT_TRUE(c->lock.held());
  EXPECT_FALSE(c->note.empty());
}
