#pragma once
// The output of child processes, read by their parent and handed on line by
// line. A node's rank processes write their lines into a pipe each that the
// node reads on a thread of its own and passes to its own non-blocking
// stderr (base/async_log.hpp): a stderr nobody reads (a terminal in copy
// mode, a slow `| tee`, ssh) then drops lines, counted, instead of blocking
// a rank's training thread in write(2).
#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "dtactor/result.hpp"

namespace dtactor {

class line_forwarder {
 public:
  // Receives each line without its newline; called on the forwarder's
  // thread only, and must not block (default: stderr_line).
  using sink = std::function<void(std::string line)>;

  // A line longer than `max_line_bytes` is handed on in pieces of that size:
  // what the forwarder holds is bounded by it per pipe.
  explicit line_forwarder(sink out = nullptr, std::size_t max_line_bytes = 16384);
  ~line_forwarder();  // stop()
  line_forwarder(const line_forwarder&) = delete;
  line_forwarder& operator=(const line_forwarder&) = delete;

  // A new pipe: returns its write end (close-on-exec; for
  // child_process::spawn_to_fd, then closed by the caller); the read end
  // is read here until every writer closed it. Thread-safe.
  result<int> open_pipe();
  // Reads what the pipes hold now (up to 1 MiB each), hands on their last
  // partial lines, closes them and ends the thread. Idempotent.
  void stop();

 private:
  struct pipe_state {
    std::string partial;  // bytes after the last newline
  };
  void run();
  void wake();
  // Reads `fd` until it would block (or `budget` bytes); false at its end.
  bool read_from(int fd, pipe_state& p, std::size_t budget);
  void close_pipe(int fd, pipe_state& p);
  // Hands on the partial line's leading pieces of max_line_ bytes while it
  // is longer than that.
  void split_long(pipe_state& p);

  sink out_;
  std::size_t max_line_;
  std::mutex mu_;
  std::map<int, pipe_state> pipes_;  // by read end; the thread's, under mu_ for open_pipe
  bool stopping_ = false;
  int wake_fd_ = -1;
  std::thread thread_;
};

}  // namespace dtactor
