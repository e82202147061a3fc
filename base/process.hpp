#pragma once
// Child processes: start, poll, signal. The node agent starts its rank
// processes and `dtactor local` its coordinator and nodes through this.
#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor {

// Path of the running executable (/proc/self/exe resolved).
std::string self_executable();

// Raises this process's soft limit of open files to its hard limit (what Go
// does for every program since 1.19): a coordinator holds one descriptor per
// connection, and Debian's default soft limit of 1024 lets a stranger's
// thousand half-open connections (or a large job) exhaust it, after which
// nobody can connect (bench/flood.py --nofile-soft 1024). Returns the soft
// limit now in force.
uint64_t raise_open_file_limit();

// This process's network namespace, as /proc/self/ns/net names it
// ("net:[4026531992]"). Processes in different ones are different hosts as
// far as the network goes: an address means something only inside one.
std::string net_namespace();
// Whether that is the machine's own (the one of pid 1; true when that
// cannot be read).
bool in_initial_net_namespace();
// What makes two processes ranks of one host for the gradient exchange:
// the kernel's boot id (one per machine and boot), the host name and the
// network namespace. Equal keys share /dev/shm and can reach each other's
// pids; different keys must talk over the network.
std::string host_key();

struct child_exit {
  int exit_code = 0;  // valid when !signaled
  int signal = 0;     // the terminating signal, when signaled
  bool signaled = false;
  std::string describe() const;  // "exit code 3" / "killed by signal 9 (Killed)"
};

class child_process {
 public:
  // Starts argv[0] with the given arguments (argv[0] is the program path).
  // The child gets its own process group when new_group is set, so signals
  // to the parent's terminal group do not reach it directly.
  // output_path: where the child's stdout and stderr go ("" = inherited).
  static result<child_process> spawn(const std::vector<std::string>& argv, bool new_group = false, const std::string& output_path = "");
  // The same, joining the existing process group `group` (a shell job's
  // processes share one: a terminal's signals reach them all).
  static result<child_process> spawn_in_group(const std::vector<std::string>& argv, pid_t group, const std::string& output_path = "");
  // The same, the child's stdout and stderr going to `output_fd` (e.g. a
  // pipe's write end, from line_forwarder::open_pipe); the caller keeps its
  // own copy of the descriptor and closes it.
  static result<child_process> spawn_to_fd(const std::vector<std::string>& argv, bool new_group, int output_fd);
  // spawn(argv, new_group), the child keeping `kept_fd` open at the same
  // number (close-on-exec cleared in the child only): a pipe's write end it
  // reports on. The caller closes its own copy.
  static result<child_process> spawn_keeping_fd(const std::vector<std::string>& argv, bool new_group, int kept_fd);

  child_process() = default;
  child_process(child_process&& o) noexcept;
  child_process& operator=(child_process&& o) noexcept;
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;
  ~child_process();  // kills (SIGKILL) and reaps a child still running

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !exit_; }
  // Non-blocking: the exit status once the child has ended.
  std::optional<child_exit> poll();
  // Blocks until the child ends or timeout_ms passes (-1: forever).
  std::optional<child_exit> wait(int timeout_ms = -1);
  void signal(int sig);
  // Gives up ownership: the caller reaps the pid from now on.
  pid_t release() {
    pid_t p = pid_;
    pid_ = -1;
    return p;
  }

 private:
  // group: < 0 the parent's, 0 a new one, else that one; output to
  // output_fd when >= 0, else to output_path when not empty.
  static result<child_process> launch(const std::vector<std::string>& argv, pid_t group, const std::string& output_path, int output_fd,
                                      int kept_fd = -1);

  pid_t pid_ = -1;
  std::optional<child_exit> exit_;
};

// Reaps the children it is given, by pid (never waitpid(-1): a process that
// also started other children, e.g. `dtactor local` with its coordinator,
// keeps their exits for their own owners). A thread of its own waits on a
// pidfd per child (Linux 5.3+; on older kernels it polls every 10 ms) and
// calls `on_exit(pid, exit_code)` (exit status, or 128 + signal) from that
// thread, once per child.
class child_reaper {
 public:
  using exit_fn = std::function<void(pid_t pid, int exit_code)>;
  explicit child_reaper(exit_fn on_exit);
  ~child_reaper();  // stop(): kills (SIGKILL) and reaps every child still running
  child_reaper(const child_reaper&) = delete;
  child_reaper& operator=(const child_reaper&) = delete;

  // Takes over reaping `pid` (a child of this process not reaped elsewhere).
  void adopt(pid_t pid);
  // `sig` (SIGTERM) now, SIGKILL if it is still running after `grace`.
  void terminate(pid_t pid, std::chrono::milliseconds grace, int sig = 15);
  // SIGKILL now.
  void kill(pid_t pid);
  // Kills every child still running, reaps them (their exits are reported)
  // and ends the thread. Idempotent.
  void stop();

 private:
  struct child {
    int pidfd = -1;
    std::optional<std::chrono::steady_clock::time_point> kill_at;
  };
  void run();
  void wake();

  exit_fn on_exit_;
  std::mutex mu_;
  std::map<pid_t, child> children_;
  bool stopping_ = false;
  int wake_fd_ = -1;
  std::thread thread_;
};

}  // namespace dtactor
