#include "base/log_limiter.hpp"

#include "base/async_log.hpp"

namespace dtactor {

log_limiter::log_limiter(sink out, options opts, std::function<clock::time_point()> now)
    : out_(std::move(out)), opts_(opts), now_(std::move(now)) {
  if (!out_) out_ = [](const std::string& line) { stderr_line(line); };
  if (!now_) now_ = [] { return clock::now(); };
}

bool log_limiter::log(std::string_view cause, const std::string& line) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = causes_.find(cause);
  if (it == causes_.end()) {
    const std::string key = causes_.size() < opts_.max_causes ? std::string(cause) : std::string("\0other", 6);
    it = causes_.try_emplace(key).first;
  }
  auto& c = it->second;
  const auto now = now_();
  if (c.written >= opts_.burst && now - c.last < opts_.interval) {
    ++c.held;
    ++held_total_;
    return false;
  }
  if (c.held == 0) {
    out_(line);
  } else {
    out_(line + " (" + std::to_string(c.held) + " similar line" + (c.held == 1 ? "" : "s") + " not logged)");
  }
  ++c.written;
  c.held = 0;
  c.last = now;
  return true;
}

uint64_t log_limiter::held_back() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_total_;
}

}  // namespace dtactor
