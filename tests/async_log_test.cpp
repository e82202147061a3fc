// base/async_log: a writer that blocks (a gate in the test, or a stderr pipe
// nobody reads) never blocks the caller; lines beyond the queue are dropped,
// counted and reported once the writer can write again, in their place;
// nothing is reordered.
#include "base/async_log.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>

#include <csignal>
#include <poll.h>
#include <unistd.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dtactor {
namespace {

// A writer that records lines and, while closed, blocks its caller.
struct gated_writer {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  int entered = 0;  // calls that started
  std::vector<std::string> lines;

  async_log::writer fn() {
    return [this](int, const std::string& line) {
      std::unique_lock<std::mutex> lock(mu);
      ++entered;
      cv.notify_all();
      cv.wait(lock, [&] { return open; });
      lines.push_back(line);
    };
  }
  void wait_entered(int n) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return entered >= n; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
    cv.notify_all();
  }
};

TEST(AsyncLog, ABlockedWriterDropsAndCountsLinesThenReportsThemInOrder) {
  auto w = std::make_shared<gated_writer>();
  async_log log(w->fn(), async_log_options{4, "dtactor node"});
  ASSERT_TRUE(log.write("line 0"));
  w->wait_entered(1);  // the writer holds line 0 and is blocked
  for (int i = 1; i <= 4; ++i) EXPECT_TRUE(log.write("line " + std::to_string(i)));
  for (int i = 5; i <= 7; ++i) EXPECT_FALSE(log.write("line " + std::to_string(i)));  // the caller is never blocked
  EXPECT_EQ(log.dropped(), 3u);
  EXPECT_FALSE(log.flush(std::chrono::milliseconds(20)));
  w->release();
  ASSERT_TRUE(log.flush(std::chrono::seconds(10)));
  ASSERT_TRUE(log.write("line 8"));
  ASSERT_TRUE(log.flush(std::chrono::seconds(10)));
  std::lock_guard<std::mutex> lock(w->mu);
  EXPECT_EQ(w->lines, (std::vector<std::string>{"line 0\n", "line 1\n", "line 2\n", "line 3\n", "line 4\n",
                                                "dtactor node: 3 log lines dropped: stderr was not being read\n", "line 8\n"}));
}

// A live progress line (text without a newline) is one entry, written as it
// is, to its fd; a note of dropped lines starts below it, not inside it.
TEST(AsyncLog, TextIsWrittenAsItIsAndTheDropNoteStartsOnALineOfItsOwn) {
  auto w = std::make_shared<gated_writer>();
  std::vector<int> fds;
  async_log log(
      [w, &fds](int fd, const std::string& text) {
        w->fn()(fd, text);
        fds.push_back(fd);
      },
      async_log_options{2, "dtactor coordinator"});
  ASSERT_TRUE(log.write("first"));
  w->wait_entered(1);
  EXPECT_TRUE(log.write_text(2, "\r\033[Kstep 1/10"));
  EXPECT_TRUE(log.write_text(1, "finished\n"));
  EXPECT_FALSE(log.write("dropped"));
  w->release();
  ASSERT_TRUE(log.flush(std::chrono::seconds(10)));
  std::lock_guard<std::mutex> lock(w->mu);
  EXPECT_EQ(w->lines, (std::vector<std::string>{"first\n", "\r\033[Kstep 1/10", "finished\n",
                                                "\ndtactor coordinator: 1 log line dropped: stderr was not being read\n"}));
  EXPECT_EQ(fds, (std::vector<int>{2, 2, 1, 2}));
}

TEST(AsyncLog, EndsWithoutWaitingForAWriterThatNeverReturns) {
  auto w = std::make_shared<gated_writer>();
  {
    async_log log(w->fn());
    log.write("stuck");
    w->wait_entered(1);
    EXPECT_FALSE(log.flush(std::chrono::milliseconds(20)));
  }              // returns: the writer thread is left behind
  w->release();  // (it holds `w`, and ends now)
}

// stderr (fd 2) replaced by a pipe of one page that nobody reads, for the
// test's lifetime.
class stderr_pipe {
 public:
  stderr_pipe() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return;
    read_ = fds[0];
    (void)::fcntl(fds[1], F_SETPIPE_SZ, 4096);
    saved_ = ::dup(STDERR_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[1]);
  }
  ~stderr_pipe() {
    if (saved_ >= 0) ::dup2(saved_, STDERR_FILENO), ::close(saved_);
    if (read_ >= 0) ::close(read_);
  }
  bool ok() const { return read_ >= 0 && saved_ >= 0; }
  // Reads what arrives until `needle` was seen or nothing came for 10 s.
  std::string read_until(const std::string& needle) {
    std::string got;
    char buf[4096];
    pollfd p{read_, POLLIN, 0};
    while (got.find(needle) == std::string::npos && ::poll(&p, 1, 10000) == 1) {
      const ssize_t n = ::read(read_, buf, sizeof buf);
      if (n <= 0) break;
      got.append(buf, static_cast<std::size_t>(n));
    }
    return got;
  }

 private:
  int read_ = -1;
  int saved_ = -1;
};

TEST(AsyncLog, StderrLinesDoNotBlockWhenStderrIsAPipeNobodyReads) {
  // The log's writer may be left behind blocked in the full pipe (the
  // scope's 50 ms flush ran out, as on a loaded machine); it wakes when the
  // pipe is closed at the end: EPIPE for it, not SIGPIPE for the test
  // binary (ignored from here on).
  ::signal(SIGPIPE, SIG_IGN);
  stderr_pipe pipe;
  ASSERT_TRUE(pipe.ok());
  std::string got;
  uint64_t dropped = 0;
  {
    stderr_log_scope scope(async_log_options{64, "dtactor node"}, std::chrono::milliseconds(50));
    // 64 KiB of lines into a 4 KiB pipe: a direct write would block here.
    for (int i = 0; i < 1000; ++i) stderr_line("node: line " + std::to_string(i) + " " + std::string(50, 'x'));
    got = pipe.read_until("stderr was not being read\n");
  }
  EXPECT_NE(got.find("node: line 0 x"), std::string::npos) << got;
  const auto note = got.find("dtactor node: ");
  ASSERT_NE(note, std::string::npos) << got;
  dropped = std::stoull(got.substr(note + 14));
  EXPECT_GT(dropped, 0u);
  EXPECT_LT(dropped, 1000u);
  // The lines that got through are in order.
  int last = -1;
  for (std::size_t at = got.find("node: line "); at != std::string::npos; at = got.find("node: line ", at + 1)) {
    const int i = std::stoi(got.substr(at + 11));
    EXPECT_GT(i, last);
    last = i;
  }
}

TEST(AsyncLog, WithoutAScopeStderrLinesAreWrittenAtOnce) {
  stderr_pipe pipe;
  ASSERT_TRUE(pipe.ok());
  stderr_line("direct line");
  EXPECT_EQ(pipe.read_until("\n"), "direct line\n");
}

}  // namespace
}  // namespace dtactor
