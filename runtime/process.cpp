#include "runtime/process.hpp"

#include <signal.h>
#include <spawn.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <algorithm>
#include <thread>

extern char** environ;

namespace dtactor {

std::string self_executable() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "dtactor";
  buf[n] = '\0';
  return buf;
}

namespace {

child_exit exit_of(int wait_status) {
  child_exit e;
  if (WIFSIGNALED(wait_status)) {
    e.signaled = true;
    e.signal = WTERMSIG(wait_status);
  } else {
    e.exit_code = WEXITSTATUS(wait_status);
  }
  return e;
}

}  // namespace

std::string child_exit::describe() const {
  if (signaled) return "killed by signal " + std::to_string(signal) + " (" + ::strsignal(signal) + ")";
  return "exit code " + std::to_string(exit_code);
}

result<child_process> child_process::spawn(const std::vector<std::string>& argv, bool new_group, const std::string& output_path) {
  return spawn_in_group(argv, new_group ? 0 : -1, output_path);
}

result<child_process> child_process::spawn_in_group(const std::vector<std::string>& argv, pid_t group, const std::string& output_path) {
  const bool new_group = group >= 0;
  if (argv.empty()) return make_error("spawn: empty command");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  // Children start with default signal handling and an empty mask, whatever
  // the parent has installed.
  sigset_t all, none;
  sigfillset(&all);
  sigemptyset(&none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setsigmask(&attr, &none);
  short flags = POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK;
  if (new_group) {
    flags |= POSIX_SPAWN_SETPGROUP;
    posix_spawnattr_setpgroup(&attr, group);
  }
  posix_spawnattr_setflags(&attr, flags);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  if (!output_path.empty()) {
    posix_spawn_file_actions_addopen(&files, 1, output_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&files, 1, 2);
  }
  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, args[0], &files, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return make_error("cannot start '" + argv[0] + "': " + std::strerror(rc));
  child_process c;
  c.pid_ = pid;
  return c;
}

child_process::child_process(child_process&& o) noexcept : pid_(o.pid_), exit_(o.exit_) { o.pid_ = -1; }

child_process& child_process::operator=(child_process&& o) noexcept {
  if (this != &o) {
    this->~child_process();
    pid_ = o.pid_;
    exit_ = o.exit_;
    o.pid_ = -1;
  }
  return *this;
}

child_process::~child_process() {
  if (pid_ > 0 && !exit_) {
    ::kill(pid_, SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
  }
}

std::optional<child_exit> child_process::poll() {
  if (exit_ || pid_ <= 0) return exit_;
  int st = 0;
  pid_t r = ::waitpid(pid_, &st, WNOHANG);
  if (r == pid_) {
    exit_ = exit_of(st);
  } else if (r < 0 && errno == ECHILD) {
    exit_ = child_exit{-1, 0, false};
  }
  return exit_;
}

std::optional<child_exit> child_process::wait(int timeout_ms) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  if (timeout_ms < 0 && pid_ > 0 && !exit_) {
    int st = 0;
    if (::waitpid(pid_, &st, 0) == pid_) {
      exit_ = exit_of(st);
    }
    return exit_;
  }
  if (poll()) return exit_;
  // Bounded wait on the exit event itself: a pidfd becomes readable when the
  // child ends (Linux >= 5.3). Without pidfds, poll at a short period.
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
  while (!poll()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
    if (left <= 0) break;
    if (fd >= 0) {
      pollfd p{fd, POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(left));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min<long long>(left, 2)));
    }
  }
  if (fd >= 0) ::close(fd);
  return exit_;
}

void child_process::signal(int sig) {
  if (pid_ > 0 && !exit_) ::kill(pid_, sig);
}

}  // namespace dtactor
