#include "base/process.hpp"

#include <signal.h>
#include <spawn.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <thread>

extern char** environ;

namespace dtactor {

std::string net_namespace() {
  char buf[64];
  const ssize_t n = ::readlink("/proc/self/ns/net", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("net:?");
}

bool in_initial_net_namespace() {
  // A namespace made by `ip netns add` is bound under /run/netns: being in
  // one of those is being on a host of one's own. (pid 1's namespace, the
  // other way to tell, is often unreadable: a non-dumpable init.)
  struct stat self {};
  if (::stat("/proc/self/ns/net", &self) != 0) return true;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/run/netns", ec)) {
    struct stat st {};
    if (::stat(e.path().c_str(), &st) == 0 && st.st_ino == self.st_ino && st.st_dev == self.st_dev) return false;
  }
  char buf[64];
  const ssize_t n = ::readlink("/proc/1/ns/net", buf, sizeof buf - 1);
  return n <= 0 || std::string(buf, static_cast<size_t>(n)) == net_namespace();
}

std::string host_key() {
  std::string boot;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof buf, f)) boot = buf;
    std::fclose(f);
    while (!boot.empty() && (boot.back() == '\n' || boot.back() == ' ')) boot.pop_back();
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = 0;
  return (boot.empty() ? std::string("boot:?") : boot) + " " + host + " " + net_namespace();
}

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
  return launch(argv, group, output_path, -1);
}

result<child_process> child_process::spawn_to_fd(const std::vector<std::string>& argv, bool new_group, int output_fd) {
  if (output_fd < 0) return make_error("spawn: no output descriptor");
  return launch(argv, new_group ? 0 : -1, "", output_fd);
}

result<child_process> child_process::spawn_keeping_fd(const std::vector<std::string>& argv, bool new_group, int kept_fd) {
  if (kept_fd < 0) return make_error("spawn: no descriptor to keep");
  return launch(argv, new_group ? 0 : -1, "", -1, kept_fd);
}

result<child_process> child_process::launch(const std::vector<std::string>& argv, pid_t group, const std::string& output_path, int output_fd,
                                            int kept_fd) {
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
  if (output_fd >= 0) {
    // (dup2 clears close-on-exec on 1 and 2, not on output_fd itself.)
    posix_spawn_file_actions_adddup2(&files, output_fd, 1);
    posix_spawn_file_actions_adddup2(&files, output_fd, 2);
  } else if (!output_path.empty()) {
    posix_spawn_file_actions_addopen(&files, 1, output_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&files, 1, 2);
  }
  // A dup2 onto itself clears close-on-exec in the child (POSIX, glibc 2.29+).
  if (kept_fd >= 0) posix_spawn_file_actions_adddup2(&files, kept_fd, kept_fd);
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

// ---- child_reaper ----

namespace {

int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

}  // namespace

child_reaper::child_reaper(exit_fn on_exit) : on_exit_(std::move(on_exit)) {
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  thread_ = std::thread([this] { run(); });
}

child_reaper::~child_reaper() {
  stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void child_reaper::wake() {
  if (wake_fd_ < 0) return;
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
}

void child_reaper::adopt(pid_t pid) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    children_[pid].pidfd = open_pidfd(pid);
  }
  wake();
}

void child_reaper::terminate(pid_t pid, std::chrono::milliseconds grace, int sig) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = children_.find(pid);
    if (it == children_.end()) return;  // already reaped: the pid may be someone else's now
    ::kill(pid, sig);
    const auto at = std::chrono::steady_clock::now() + grace;
    if (!it->second.kill_at || *it->second.kill_at > at) it->second.kill_at = at;
  }
  wake();
}

void child_reaper::kill(pid_t pid) {
  std::lock_guard<std::mutex> lock(mu_);
  if (children_.count(pid)) ::kill(pid, SIGKILL);
}

void child_reaper::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    for (const auto& [pid, c] : children_) ::kill(pid, SIGKILL);
  }
  wake();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void child_reaper::run() {
  std::vector<pollfd> fds;
  std::vector<pid_t> pids;
  for (;;) {
    fds.clear();
    pids.clear();
    fds.push_back(pollfd{wake_fd_, POLLIN, 0});
    int timeout_ms = -1;
    bool polling = false;  // a child without a pidfd: look every 10 ms
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_ && children_.empty()) return;
      const auto now = std::chrono::steady_clock::now();
      for (auto& [pid, c] : children_) {
        if (c.kill_at && *c.kill_at <= now) {
          ::kill(pid, SIGKILL);
          c.kill_at.reset();
        } else if (c.kill_at) {
          const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(*c.kill_at - now).count() + 1;
          timeout_ms = timeout_ms < 0 ? static_cast<int>(ms) : std::min(timeout_ms, static_cast<int>(ms));
        }
        if (c.pidfd >= 0) {
          fds.push_back(pollfd{c.pidfd, POLLIN, 0});
          pids.push_back(pid);
        } else {
          polling = true;
        }
      }
    }
    if (polling) timeout_ms = timeout_ms < 0 ? 10 : std::min(timeout_ms, 10);
    const int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) timeout_ms = 10;  // should not happen; do not spin
    if (fds[0].revents & POLLIN) {
      uint64_t v = 0;
      while (::read(wake_fd_, &v, sizeof v) > 0) {
      }
    }
    // Reap whoever ended (by pid, without blocking).
    std::vector<std::pair<pid_t, int>> ended;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = children_.begin(); it != children_.end();) {
        int st = 0;
        const pid_t r = ::waitpid(it->first, &st, WNOHANG);
        if (r == it->first || (r < 0 && errno == ECHILD)) {
          if (it->second.pidfd >= 0) ::close(it->second.pidfd);
          ended.emplace_back(it->first, r == it->first ? (WIFSIGNALED(st) ? 128 + WTERMSIG(st) : WEXITSTATUS(st)) : -1);
          it = children_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (const auto& [pid, code] : ended)
      if (on_exit_) on_exit_(pid, code);
  }
}

uint64_t raise_open_file_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return 0;
  if (r.rlim_cur < r.rlim_max) {
    rlimit want = r;
    want.rlim_cur = r.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &want) == 0) r = want;
  }
  return static_cast<uint64_t>(r.rlim_cur);
}

}  // namespace dtactor
