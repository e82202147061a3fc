#include "base/process.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <condition_variable>
#include <map>
#include <mutex>

namespace dtactor {
namespace {

TEST(Process, ExitCodeIsReported) {
  auto c = child_process::spawn({"/bin/sh", "-c", "exit 3"});
  ASSERT_TRUE(c) << c.message();
  auto e = c->wait();
  ASSERT_TRUE(e);
  EXPECT_FALSE(e->signaled);
  EXPECT_EQ(e->exit_code, 3);
  EXPECT_FALSE(c->running());
}

TEST(Process, BoundedWaitThenKill) {
  auto c = child_process::spawn({"/bin/sleep", "30"}, true);
  ASSERT_TRUE(c) << c.message();
  EXPECT_FALSE(c->wait(50));  // still running after 50 ms
  EXPECT_TRUE(c->running());
  c->signal(SIGKILL);
  auto e = c->wait(10000);
  ASSERT_TRUE(e);
  EXPECT_TRUE(e->signaled);
  EXPECT_EQ(e->signal, SIGKILL);
  EXPECT_NE(e->describe().find("signal 9"), std::string::npos);
}

TEST(Process, MissingProgramIsAnError) {
  auto c = child_process::spawn({"/nonexistent/program"});
  ASSERT_FALSE(c);
  EXPECT_NE(c.message().find("/nonexistent/program"), std::string::npos);
}

TEST(Process, SelfExecutableExists) { EXPECT_FALSE(self_executable().empty()); }

// What a child_reaper reported, waited for by event (no sleeps).
struct exits {
  std::mutex mu;
  std::condition_variable cv;
  std::map<pid_t, int> codes;
  void add(pid_t pid, int code) {
    std::lock_guard<std::mutex> lock(mu);
    codes[pid] = code;
    cv.notify_all();
  }
  std::optional<int> wait_for(pid_t pid, std::chrono::seconds limit = std::chrono::seconds(60)) {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, limit, [&] { return codes.count(pid) > 0; })) return std::nullopt;
    return codes[pid];
  }
};

TEST(ChildReaper, ReportsExitCodesOfItsChildrenByPid) {
  exits seen;
  child_reaper reaper([&](pid_t pid, int code) { seen.add(pid, code); });
  auto c = child_process::spawn({"/bin/sh", "-c", "exit 7"});
  ASSERT_TRUE(c) << c.message();
  const pid_t pid = c->release();
  reaper.adopt(pid);
  EXPECT_EQ(seen.wait_for(pid), 7);
}

// The bug this replaces: a reaper calling waitpid(-1) took the exit of a
// child it did not own (`dtactor local`'s coordinator), losing its code.
TEST(ChildReaper, LeavesOtherChildrenOfTheProcessToTheirOwners) {
  exits seen;
  child_reaper reaper([&](pid_t pid, int code) { seen.add(pid, code); });
  auto other = child_process::spawn({"/bin/sh", "-c", "exit 5"});
  ASSERT_TRUE(other) << other.message();
  auto mine = child_process::spawn({"/bin/sh", "-c", "exit 3"});
  ASSERT_TRUE(mine) << mine.message();
  const pid_t pid = mine->release();
  reaper.adopt(pid);
  EXPECT_EQ(seen.wait_for(pid), 3);
  auto e = other->wait(60000);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->exit_code, 5);
  std::lock_guard<std::mutex> lock(seen.mu);
  EXPECT_EQ(seen.codes.count(other->pid()), 0u);
}

// Starts `sh -c script` where the script says "ready" on a FIFO once its
// trap is set, and returns after reading it (the signal must not beat the trap).
pid_t spawn_trapping(const std::string& trap) {
  const std::string fifo = ::testing::TempDir() + "reaper-" + std::to_string(::getpid()) + "-" + std::to_string(std::rand());
  if (::mkfifo(fifo.c_str(), 0600) != 0) return -1;
  auto c = child_process::spawn({"/bin/sh", "-c", trap + "; echo ready > '" + fifo + "'; while :; do sleep 0.05; done"});
  if (!c) return -1;
  std::FILE* f = std::fopen(fifo.c_str(), "r");  // blocks until the shell opens it
  char buf[16] = {};
  if (f) {
    (void)std::fgets(buf, sizeof buf, f);
    std::fclose(f);
  }
  ::unlink(fifo.c_str());
  return c->release();
}

TEST(ChildReaper, TerminateSendsSigtermFirst) {
  exits seen;
  child_reaper reaper([&](pid_t pid, int code) { seen.add(pid, code); });
  // Exits 0 on SIGTERM, so a SIGKILL (137) would show.
  const pid_t pid = spawn_trapping("trap 'exit 0' TERM");
  ASSERT_GT(pid, 0);
  reaper.adopt(pid);
  reaper.terminate(pid, std::chrono::seconds(30));
  EXPECT_EQ(seen.wait_for(pid), 0);
}

TEST(ChildReaper, TerminateKillsAChildThatIgnoresSigtermAfterTheGrace) {
  exits seen;
  child_reaper reaper([&](pid_t pid, int code) { seen.add(pid, code); });
  const pid_t pid = spawn_trapping("trap '' TERM");
  ASSERT_GT(pid, 0);
  reaper.adopt(pid);
  reaper.terminate(pid, std::chrono::milliseconds(200));
  EXPECT_EQ(seen.wait_for(pid), 128 + SIGKILL);
}

TEST(ChildReaper, StopKillsAndReportsWhatIsStillRunning) {
  exits seen;
  child_reaper reaper([&](pid_t pid, int code) { seen.add(pid, code); });
  auto c = child_process::spawn({"/bin/sleep", "30"});
  ASSERT_TRUE(c) << c.message();
  const pid_t pid = c->release();
  reaper.adopt(pid);
  reaper.stop();
  EXPECT_EQ(seen.wait_for(pid, std::chrono::seconds(1)), 128 + SIGKILL);
}

}  // namespace
}  // namespace dtactor
