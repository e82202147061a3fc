#include "base/line_forwarder.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "base/async_log.hpp"

namespace dtactor {

line_forwarder::line_forwarder(sink out, std::size_t max_line_bytes)
    : out_(out ? std::move(out) : sink([](std::string line) { stderr_line(std::move(line)); })), max_line_(max_line_bytes > 0 ? max_line_bytes : 1) {
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  thread_ = std::thread([this] { run(); });
}

line_forwarder::~line_forwarder() {
  stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void line_forwarder::wake() {
  if (wake_fd_ < 0) return;
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
}

result<int> line_forwarder::open_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return make_error(std::string("cannot make a pipe for a child's output: ") + std::strerror(errno));
  (void)::fcntl(fds[0], F_SETFL, O_NONBLOCK);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      pipes_[fds[0]];
      fds[0] = -1;
    }
  }
  if (fds[0] >= 0) {  // stopped: nobody would read it
    ::close(fds[0]);
    ::close(fds[1]);
    return make_error("the output forwarder has stopped");
  }
  wake();
  return fds[1];
}

void line_forwarder::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

bool line_forwarder::read_from(int fd, pipe_state& p, std::size_t budget) {
  char buf[65536];
  for (std::size_t got = 0; got < budget;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n <= 0) return false;
    got += static_cast<std::size_t>(n);
    const char* at = buf;
    const char* const end = buf + n;
    while (at < end) {
      const char* nl = static_cast<const char*>(std::memchr(at, '\n', static_cast<std::size_t>(end - at)));
      p.partial.append(at, (nl ? nl : end) - at);
      split_long(p);
      if (!nl) break;
      out_(std::move(p.partial));
      p.partial.clear();
      at = nl + 1;
    }
  }
  return true;
}

void line_forwarder::split_long(pipe_state& p) {
  std::size_t from = 0;
  for (; p.partial.size() - from > max_line_; from += max_line_) out_(p.partial.substr(from, max_line_));
  p.partial.erase(0, from);
}

void line_forwarder::close_pipe(int fd, pipe_state& p) {
  if (!p.partial.empty()) out_(std::move(p.partial));
  p.partial.clear();
  ::close(fd);
}

void line_forwarder::run() {
  std::vector<pollfd> fds;
  for (;;) {
    fds.assign(1, pollfd{wake_fd_, POLLIN, 0});
    bool stopping = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stopping_;
      for (const auto& [fd, p] : pipes_) fds.push_back(pollfd{fd, POLLIN, 0});
    }
    if (!stopping && ::poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) fds.resize(1);  // (cannot happen; read on)
    uint64_t v = 0;
    while (::read(wake_fd_, &v, sizeof v) > 0) {
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (std::size_t i = 1; i < fds.size(); ++i) {
      if (!stopping && fds[i].revents == 0) continue;
      auto it = pipes_.find(fds[i].fd);
      const bool open = read_from(it->first, it->second, stopping ? (1u << 20) : (1u << 18));
      if (!open || stopping) {
        close_pipe(it->first, it->second);
        pipes_.erase(it);
      }
    }
    if (stopping) return;
  }
}

}  // namespace dtactor
