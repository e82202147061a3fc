#pragma once
// Child processes: start, poll, signal. The node agent starts its rank
// processes and `dtactor local` its coordinator and nodes through this.
#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "runtime/result.hpp"

namespace dtactor {

// Path of the running executable (/proc/self/exe resolved).
std::string self_executable();

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
  pid_t pid_ = -1;
  std::optional<child_exit> exit_;
};

}  // namespace dtactor
