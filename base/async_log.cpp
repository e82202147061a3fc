#include "base/async_log.hpp"

#include <unistd.h>

#include <cerrno>

namespace dtactor {

namespace {

// The whole of `text` to `fd`, or as much as it takes before an error other
// than EINTR (a closed stderr loses the line, as fprintf would).
void write_fd(int fd, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<std::size_t>(n);
  }
}

std::string dropped_note(const std::string& who, uint64_t n) {
  return who + ": " + std::to_string(n) + " log line" + (n == 1 ? "" : "s") + " dropped: stderr was not being read\n";
}

}  // namespace

struct async_log::shared {
  writer out;
  async_log_options opts;
  std::mutex mu;
  std::condition_variable wake;  // the writer: lines, drops or stop
  std::condition_variable done;  // flush(): lines written
  struct entry {
    int fd;
    std::string text;
  };
  std::deque<entry> queue;
  bool line_open = false;  // the writer thread's: stderr's last text did not end a line
  uint64_t queued = 0;      // lines accepted, ever
  uint64_t written = 0;     // of those, written (or given to the writer, which failed)
  uint64_t unreported = 0;  // dropped since the writer last said so
  uint64_t dropped = 0;
  bool stuck = false;  // a flush timed out and the writer has not finished a batch since
  bool stop = false;
  bool exited = false;  // run() returned

  void write_one(int fd, const std::string& text) {
    try {
      out(fd, text);
    } catch (...) {
      // A writer that throws loses its line, never the thread.
    }
    if (fd == STDERR_FILENO && !text.empty()) line_open = text.back() != '\n';
  }

  // The writer thread: takes the whole queue at once, then the count of
  // lines dropped after it (they were dropped once it was full), and writes
  // them in that order.
  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      wake.wait(lock, [&] { return stop || !queue.empty() || unreported > 0; });
      if (queue.empty() && unreported == 0) {
        exited = true;
        done.notify_all();
        return;
      }
      std::deque<entry> batch;
      batch.swap(queue);
      const uint64_t drops = unreported;
      unreported = 0;
      lock.unlock();
      for (const auto& e : batch) write_one(e.fd, e.text);
      // (Below a live progress line, not inside it.)
      if (drops > 0) write_one(STDERR_FILENO, (line_open ? "\n" : "") + dropped_note(opts.who, drops));
      lock.lock();
      written += batch.size();
      stuck = false;
      done.notify_all();
    }
  }
};

async_log::async_log(writer out, async_log_options opts) : s_(std::make_shared<shared>()) {
  s_->out = out ? std::move(out) : writer(write_fd);
  s_->opts = std::move(opts);
  thread_ = std::thread([s = s_] { s->run(); });
}

async_log::~async_log() {
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->stop = true;
  s_->wake.notify_all();
  // The writer drains the queue before it ends; one blocked in write(2) may
  // never return: it keeps `s_` alive and is left behind.
  const auto wait = s_->stuck ? std::chrono::milliseconds(0) : std::chrono::milliseconds(1000);
  const bool exited = s_->done.wait_for(lock, wait, [&] { return s_->exited; });
  lock.unlock();
  if (exited)
    thread_.join();
  else
    thread_.detach();
}

bool async_log::write(std::string line) {
  line += '\n';
  return write_text(STDERR_FILENO, std::move(line));
}

bool async_log::write_text(int fd, std::string text) {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->queue.size() >= s_->opts.max_queued_lines) {
      ++s_->dropped;
      ++s_->unreported;
      return false;
    }
    s_->queue.push_back(shared::entry{fd, std::move(text)});
    ++s_->queued;
  }
  s_->wake.notify_one();
  return true;
}

bool async_log::flush(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(s_->mu);
  const uint64_t target = s_->queued;
  const bool ok = s_->done.wait_for(lock, timeout, [&] { return s_->written >= target; });
  if (!ok) s_->stuck = true;
  return ok;
}

uint64_t async_log::dropped() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->dropped;
}

namespace {

std::mutex& installed_mu() {
  static std::mutex mu;
  return mu;
}
std::shared_ptr<async_log>& installed() {
  static std::shared_ptr<async_log> log;
  return log;
}

// `text` to `fd` through the installed sink, or at once.
void std_text(int fd, std::string text) {
  std::shared_ptr<async_log> log;
  {
    std::lock_guard<std::mutex> lock(installed_mu());
    log = installed();
  }
  if (log) {
    log->write_text(fd, std::move(text));
    return;
  }
  write_fd(fd, text);
}

}  // namespace

void stderr_line(std::string line) {
  line += '\n';
  std_text(STDERR_FILENO, std::move(line));
}

void stderr_text(std::string text) { std_text(STDERR_FILENO, std::move(text)); }

void stdout_line(std::string line) {
  line += '\n';
  std_text(STDOUT_FILENO, std::move(line));
}

stderr_log_scope::stderr_log_scope(async_log_options opts, std::chrono::milliseconds flush_timeout)
    : log_(std::make_shared<async_log>(nullptr, std::move(opts))), flush_timeout_(flush_timeout) {
  std::lock_guard<std::mutex> lock(installed_mu());
  installed() = log_;
}

stderr_log_scope::~stderr_log_scope() {
  log_->flush(flush_timeout_);
  {
    std::lock_guard<std::mutex> lock(installed_mu());
    if (installed() == log_) installed().reset();
  }
  // Lines queued between the flush and the uninstall: the destructor's
  // short wait (none when the writer is stuck). A stderr_line() still
  // holding the log ends it instead.
  log_.reset();
}

}  // namespace dtactor
