// base/line_forwarder: a child's output read through a pipe and handed on
// line by line; a child that writes a lot is never blocked by a stderr
// nobody reads (the lines drop in the parent's async_log instead).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "base/async_log.hpp"
#include "base/line_forwarder.hpp"
#include "base/process.hpp"

namespace dtactor {
namespace {

// The lines a forwarder handed on, and a wait for the n-th.
struct collected {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> lines;

  line_forwarder::sink fn() {
    return [this](std::string line) {
      std::lock_guard<std::mutex> lock(mu);
      lines.push_back(std::move(line));
      cv.notify_all();
    };
  }
  bool wait_lines(std::size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(10), [&] { return lines.size() >= n; });
  }
};

void write_all(int fd, const std::string& s) { ASSERT_EQ(::write(fd, s.data(), s.size()), static_cast<ssize_t>(s.size())); }

TEST(LineForwarder, HandsOnWholeLinesSplitsLongOnesAndEndsAPartialLineAtTheEnd) {
  collected got;
  line_forwarder fwd(got.fn(), 8);
  auto w = fwd.open_pipe();
  ASSERT_TRUE(w) << w.message();
  write_all(w.value(), "rank 0: a");
  write_all(w.value(), "b\n\nrank 0: 0123456789\nlast");
  ::close(w.value());  // the end of its writer: "last" goes on too
  ASSERT_TRUE(got.wait_lines(7));
  std::lock_guard<std::mutex> lock(got.mu);
  EXPECT_EQ(got.lines, (std::vector<std::string>{"rank 0: ", "ab", "", "rank 0: ", "01234567", "89", "last"}));
}

TEST(LineForwarder, StopHandsOnWhatThePipesHold) {
  collected got;
  line_forwarder fwd(got.fn());
  auto w = fwd.open_pipe();
  ASSERT_TRUE(w);
  write_all(w.value(), "one\ntwo");
  fwd.stop();  // the writer is still open: what is there is read, then closed
  ::close(w.value());
  std::lock_guard<std::mutex> lock(got.mu);
  EXPECT_EQ(got.lines, (std::vector<std::string>{"one", "two"}));
  EXPECT_FALSE(fwd.open_pipe());
}

// stderr (fd 2) replaced by a pipe of one page that nobody reads.
class unread_stderr {
 public:
  unread_stderr() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return;
    read_ = fds[0];
    (void)::fcntl(fds[1], F_SETPIPE_SZ, 4096);
    saved_ = ::dup(STDERR_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[1]);
  }
  ~unread_stderr() {
    if (saved_ >= 0) ::dup2(saved_, STDERR_FILENO), ::close(saved_);
    if (read_ >= 0) ::close(read_);
  }
  bool ok() const { return read_ >= 0 && saved_ >= 0; }

 private:
  int read_ = -1;
  int saved_ = -1;
};

// A child that writes ~1.3 MB of lines, its output through a forwarder into
// this process's stderr_line while stderr is a full pipe: it runs to its end.
TEST(LineForwarder, AChildThatWritesALotIsNotBlockedByAnUnreadStderr) {
  // The log's writer, left behind blocked in the pipe, wakes when the test
  // closes it, at a moment nobody controls: EPIPE for it, not SIGPIPE for
  // the test binary (ignored from here on).
  ::signal(SIGPIPE, SIG_IGN);
  unread_stderr err;
  ASSERT_TRUE(err.ok());
  stderr_log_scope scope(async_log_options{256, "dtactor node"}, std::chrono::milliseconds(50));
  line_forwarder fwd;
  auto w = fwd.open_pipe();
  ASSERT_TRUE(w);
  auto child = child_process::spawn_to_fd({"/bin/sh", "-c", "seq 1 200000 >&2"}, false, w.value());
  ::close(w.value());
  ASSERT_TRUE(child) << child.message();
  const auto done = child->wait(60000);
  ASSERT_TRUE(done) << "the child blocked writing its output";
  EXPECT_EQ(done->exit_code, 0);
}

}  // namespace
}  // namespace dtactor
