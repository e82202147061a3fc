#pragma once
// Console progress. On a terminal: one live line (step/total, loss,
// samples/s, ETA, plus a free-form tail), redrawn at most a few times a
// second. Otherwise: plain lines, only for forced updates (the caller's log
// interval).
// Either way, every log() line also goes to the run's log file. Thread-safe.
// The console writes go through stderr_line / stderr_text
// (base/async_log.hpp): they never block where the process installed a
// stderr_log_scope; the log file is written directly.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace dtactor {

struct progress_state {
  int64_t step = 0;
  int64_t total = 0;
  double loss = 0;
  double samples_per_s = 0;
  double eta_s = -1;  // negative: unknown
  std::string tail;  // e.g. "world 2 | eval acc 0.87"
};

class progress {
 public:
  // interactive: live line on stderr; log_path: file for plain lines ("" = none).
  progress(bool interactive, const std::string& log_path);
  ~progress();
  progress(const progress&) = delete;
  progress& operator=(const progress&) = delete;

  // Live line when interactive (throttled unless force); when not, a plain
  // line for forced updates only.
  void update(const progress_state& s, bool force = false);
  // A plain line (e.g. an evaluation result); keeps the live line below it.
  void log(const std::string& line);
  // Ends the live line.
  void finish();

  static bool stderr_is_terminal();
  static std::string format_duration(double seconds);

 private:
  std::string render(const progress_state& s) const;
  bool interactive_;
  std::FILE* log_ = nullptr;
  std::chrono::steady_clock::time_point last_draw_{};
  std::string last_line_;
  bool live_ = false;
  // update, log and finish may come from different threads (the
  // coordinator's actors log while its registry draws the live line).
  std::mutex mu_;
};

}  // namespace dtactor
