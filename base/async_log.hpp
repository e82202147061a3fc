#pragma once
// Log lines that never block their caller. A process whose stderr is a pipe
// with a slow or stopped reader (a terminal in copy mode, `| tee` to a slow
// disk, ssh) blocks in write(2) once the pipe is full; a node agent that
// logs from its actor then sends no heartbeats and is declared lost. An
// async_log queues lines (bounded) for one writer thread; when the queue is
// full lines are dropped and counted, and once the writer can write again it
// says how many were dropped, where they would have been.
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace dtactor {

struct async_log_options {
  std::size_t max_queued_lines = 4096;  // beyond it lines are dropped (and counted)
  // Names the process in the line that reports dropped lines:
  // "<who>: N log lines dropped: stderr was not being read".
  std::string who = "dtactor";
};

class async_log {
 public:
  // Writes `text` (a whole line with its newline, or write_text's text) to
  // `fd` (STDOUT_FILENO or STDERR_FILENO); may block. Called on the writer
  // thread only.
  using writer = std::function<void(int fd, const std::string& text)>;

  // `out` defaults to write(2) on the fd (never stdio's locked FILE, so a
  // writer blocked in the pipe holds no lock another thread needs).
  explicit async_log(writer out = nullptr, async_log_options opts = {});
  // Writes what is queued, waiting at most a second (not at all once a
  // flush timed out and nothing was written since); a writer still blocked
  // after that is left behind (detached), never waited for.
  ~async_log();
  async_log(const async_log&) = delete;
  async_log& operator=(const async_log&) = delete;

  // Queues `line` (no newline) and returns at once; false when the queue was
  // full and the line was dropped. Lines are written in the order queued.
  // Thread-safe.
  bool write(std::string line);
  // Queues `text` as it is (no newline added: a terminal's live line and its
  // control sequences) for `fd` (1 or 2); one entry of the queue, written
  // whole or dropped whole, in order with every other entry.
  bool write_text(int fd, std::string text);
  // Waits up to `timeout` until every line queued so far has been written;
  // returns whether they were.
  bool flush(std::chrono::milliseconds timeout);
  uint64_t dropped() const;  // lines dropped so far

 private:
  struct shared;  // what the writer thread holds, so that it may outlive this object
  std::shared_ptr<shared> s_;
  std::thread thread_;
};

// One line to this process's stderr: through the async_log that a
// stderr_log_scope installed (never blocks), or written at once when none
// is installed. Thread-safe.
void stderr_line(std::string line);
// `text` as it is (no newline added) to stderr, the same way: a live
// progress line ("\r\033[K...") stays one write, in order with the lines.
void stderr_text(std::string text);
// One line to stdout, the same way (through the same queue, so stdout and
// stderr keep their order on a terminal that shows both).
void stdout_line(std::string line);

// Installs an async_log as the process's stdout and stderr sink
// (stderr_line, stderr_text, stdout_line) for its
// lifetime; at its end what is queued is flushed (waiting at most
// `flush_timeout`) and lines are written directly again. One at a time.
class stderr_log_scope {
 public:
  explicit stderr_log_scope(async_log_options opts = {}, std::chrono::milliseconds flush_timeout = std::chrono::seconds(2));
  ~stderr_log_scope();
  stderr_log_scope(const stderr_log_scope&) = delete;
  stderr_log_scope& operator=(const stderr_log_scope&) = delete;

 private:
  std::shared_ptr<async_log> log_;
  std::chrono::milliseconds flush_timeout_;
};

}  // namespace dtactor
