#include "runtime/process.hpp"

#include <gtest/gtest.h>
#include <signal.h>

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

}  // namespace
}  // namespace dtactor
