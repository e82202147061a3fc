// What the long-running processes (coordinator, node, rank, train, local)
// do with signals from outside: app/cli.hpp's install_stop_handlers.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>

#include "app/cli.hpp"

using namespace dtactor;

namespace {

// Runs `body` in a forked child; returns its wait status.
template <class Body>
int in_child(Body body) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

}  // namespace

// A rank writing to a Gloo peer whose host was just killed met the peer's
// reset connection and died of SIGPIPE (exit 141) before Gloo could report
// the error, so its node lost a rank the survivors needed.
TEST(StopHandlers, AWriteWhoseReaderIsGoneFailsWithEpipeAndTheProcessLivesOn) {
  const int status = in_child([] {
    install_stop_handlers();
    int fds[2];
    if (::pipe(fds) != 0) return 3;
    ::close(fds[0]);
    const char byte = 'x';
    const ssize_t n = ::write(fds[1], &byte, 1);
    return n == -1 && errno == EPIPE ? 0 : 4;
  });
  ASSERT_TRUE(WIFEXITED(status)) << "the child ended by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}
