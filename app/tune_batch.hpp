#pragma once
// `dtactor tune-batch`: the largest per-rank micro-batch that fits a memory
// budget, found as Lightning's batch size finder does (double until a size
// does not fit, then bisect between the last that fit and the first that
// did not, to within 1/32 of the size: peaks vary by a few MiB between
// runs, so finer steps near the budget would measure noise). Each size is tried in a fresh probe process (this executable,
// `tune-batch --probe N`) that trains a few steps of exactly that batch, so
// nothing a previous trial allocated counts; the parent watches the probe's
// resident memory and kills it the moment it passes the budget, so a trial
// never pushes the machine into its OOM killer. Every trial (size, peak
// memory, samples/s, fit or why not) and the result go to the run's journal
// (`batch_size_trial`, `batch_size_found`), the console, and `dtactor
// report`'s "Batch size" section.
//
// CPU only for now: the budget is resident memory (VmRSS/VmHWM). A CUDA
// build would have to measure the device's peak allocation instead; it does
// not yet.
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "dtactor/config.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

struct tune_batch_options {
  std::string run_dir;
  // Per-rank budget in bytes (0 = the machine's MemAvailable, less 10%, over
  // ranks_per_host).
  int64_t max_memory = 0;
  int ranks_per_host = 1;
  int64_t start = 1;        // first size tried
  int64_t up_to = 0;        // largest size tried (0 = train.global_batch_size)
  int steps = 3;            // steps per probe (the first one is not timed)
  int max_trials = 25;      // Lightning's default
  std::vector<std::string> probe_args;  // the job's --config/--set arguments, passed to each probe
  const std::atomic<int>* stop_signal = nullptr;
};

struct batch_trial {
  int64_t micro_batch = 0;
  bool fits = false;
  double peak_rss_bytes = 0;
  double samples_per_s = 0;
  std::string why;  // when it does not fit: "over budget" or the probe's own line
};

struct tune_batch_result {
  int64_t micro_batch = 0;      // the largest size that fit
  bool limited_by_up_to = false;  // every size up to `up_to` fit
  int64_t max_memory = 0;
  std::vector<batch_trial> trials;  // in the order tried
};

result<tune_batch_result> run_tune_batch(const config& cfg, const tune_batch_options& opts);

// The probe (runs in the child): trains `steps` steps of global batch =
// micro-batch = `micro_batch` and prints one JSON line
// {"micro_batch", "peak_rss_bytes", "samples_per_s"} on stdout.
int run_batch_probe(const config& cfg, int64_t micro_batch, int steps);

// "8G", "512M", "1.5GiB", "1000000" -> bytes, or an error line.
result<int64_t> parse_bytes(const std::string& text);

}  // namespace dtactor
