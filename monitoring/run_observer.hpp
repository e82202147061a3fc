#pragma once
// What a training job shows while it runs, besides the journal and
// /metrics: TensorBoard scalars (RUN_DIR/tensorboard) and the console
// progress (one live line on a terminal, plain periodic lines otherwise).
// Used by the coordinator's event sink and by `dtactor train`, so both
// write the same tags. One owner thread, except note_event and log, which
// any thread may call.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "monitoring/progress.hpp"
#include "monitoring/tfevents.hpp"

namespace dtactor {

class run_observer {
 public:
  struct options {
    std::string run_dir;         // TensorBoard events go to run_dir/tensorboard ("" = none)
    int64_t max_steps = 0;
    bool interactive = false;    // live line (stderr is a terminal)
    std::string log_path;        // plain lines are also appended here ("" = none)
  };
  explicit run_observer(const options& o);
  ~run_observer();

  // Every logged step: TensorBoard train/loss, train/learning_rate,
  // train/samples_per_second, cluster/world_size; the progress line.
  // `force`: a logging step (plain line when not interactive).
  void on_step(int64_t step, double loss, double lr, double samples_per_s, int world_size, bool force = true);
  // eval/<metric> for each metric, and a plain line.
  void on_eval(int64_t step, const std::map<std::string, double>& metrics);
  // cluster/world_size and cluster/generation at the step training resumes from.
  void on_generation(uint64_t generation, int world_size, int64_t start_step);
  // Shown as the live line's last event (e.g. "checkpoint 500").
  // Thread-safe (membership events arrive on another thread).
  void note_event(const std::string& what) {
    std::lock_guard<std::mutex> lock(event_mu_);
    last_event_ = what;
  }
  // A plain line above the live line (also in the log file). Thread-safe.
  void log(const std::string& line) { progress_.log(line); }
  // Ends the live line.
  void finish() { progress_.finish(); }

  // The events file, or "" when TensorBoard output is off or failed to open.
  std::string tensorboard_path() const { return tb_.is_open() ? tb_.path() : ""; }

 private:
  options opts_;
  progress progress_;
  tfevents_writer tb_;
  std::mutex event_mu_;
  std::string last_event_;
  int world_ = 0;
  double loss_ = 0, sps_ = 0;
  // Steps per second, smoothed, for the ETA.
  double rate_ = 0, last_t_ = 0;
  int64_t last_step_ = -1;
};

}  // namespace dtactor
