#include "monitoring/progress.hpp"

#include <unistd.h>

#include <cmath>

#include "base/async_log.hpp"

namespace dtactor {

progress::progress(bool interactive, const std::string& log_path) : interactive_(interactive) {
  if (!log_path.empty()) log_ = std::fopen(log_path.c_str(), "a");
}

progress::~progress() {
  finish();
  if (log_) std::fclose(log_);
}

bool progress::stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

std::string progress::format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  long t = std::lround(s);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t / 60) % 60);
  else if (t >= 60)
    std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%lds", t);
  return buf;
}

std::string progress::render(const progress_state& s) const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "step %lld/%lld (%.0f%%) | loss %.4f | %.0f samples/s", static_cast<long long>(s.step),
                static_cast<long long>(s.total), s.total > 0 ? 100.0 * s.step / s.total : 0.0, s.loss, s.samples_per_s);
  std::string line = buf;
  if (s.eta_s >= 0) line += " | ETA " + format_duration(s.eta_s);
  if (!s.tail.empty()) line += " | " + s.tail;
  return line;
}

void progress::update(const progress_state& s, bool force) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string line = render(s);
  if (!interactive_) {
    if (!force) return;
    stderr_line(line);
    if (log_) std::fprintf(log_, "%s\n", line.c_str()), std::fflush(log_);
    return;
  }
  auto now = std::chrono::steady_clock::now();
  if (!force && now - last_draw_ < std::chrono::milliseconds(250)) return;
  last_draw_ = now;
  last_line_ = line;
  stderr_text("\r\033[K" + line);
  live_ = true;
  if (force && log_) std::fprintf(log_, "%s\n", line.c_str()), std::fflush(log_);
}

void progress::log(const std::string& line) {
  std::lock_guard<std::mutex> lock(mu_);
  // One write: the line above the live line, which is drawn again below it.
  if (interactive_ && live_)
    stderr_text("\r\033[K" + line + "\n" + last_line_);
  else
    stderr_line(line);
  if (log_) std::fprintf(log_, "%s\n", line.c_str()), std::fflush(log_);
}

void progress::finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (interactive_ && live_) stderr_text("\n");
  live_ = false;
}

}  // namespace dtactor
