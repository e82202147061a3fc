#pragma once
// Log lines rate-limited per cause, so that a stranger who can make this
// process log (garbage frames, refused handshakes, libprotobuf's complaints
// about a peer's bytes) can make it write at most a few lines a second, and
// one cause's flood never hides another cause's lines.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

namespace dtactor {

// (Outside the class: GCC cannot use a nested struct's default member
// initializers in a default argument of the enclosing class.)
struct log_limiter_options {
  std::size_t burst = 10;                   // lines of a cause written before the limit applies
  std::chrono::milliseconds interval{1000}; // then at most one line of it per interval
  std::size_t max_causes = 256;             // distinct causes tracked; further ones share one
};

class log_limiter {
 public:
  using clock = std::chrono::steady_clock;
  using options = log_limiter_options;
  using sink = std::function<void(const std::string& line)>;

  // `out` receives each line that passes (default: stderr_line, which never
  // blocks where a stderr_log_scope is installed: base/async_log.hpp);
  // `now` is the clock (tests move it).
  explicit log_limiter(sink out = nullptr, options opts = {}, std::function<clock::time_point()> now = nullptr);

  // Writes `line` unless its cause is over its budget. A line written after
  // some of its cause were held back ends with "(N similar lines not
  // logged)". Returns whether the line was written. Thread-safe. The caller
  // escapes outside text in `line` (base/printable.hpp).
  bool log(std::string_view cause, const std::string& line);

  uint64_t held_back() const;  // lines not written, over all causes

 private:
  struct cause_state {
    uint64_t written = 0;
    uint64_t held = 0;  // since the last line written
    clock::time_point last{};
  };
  sink out_;
  options opts_;
  std::function<clock::time_point()> now_;
  mutable std::mutex mu_;
  std::map<std::string, cause_state, std::less<>> causes_;
  uint64_t held_total_ = 0;
};

}  // namespace dtactor
