#include "monitoring/run_observer.hpp"

#include <cmath>
#include <cstdio>

#include "base/async_log.hpp"
#include "monitoring/journal.hpp"

namespace dtactor {

run_observer::run_observer(const options& o) : opts_(o), progress_(o.interactive, o.log_path) {
  if (!o.run_dir.empty())
    if (auto st = tb_.open(o.run_dir + "/tensorboard"); !st)
      stderr_line("dtactor: " + st.message() + "; training goes on without TensorBoard events");
}

run_observer::~run_observer() { progress_.finish(); }

void run_observer::on_step(int64_t step, double loss, double lr, double samples_per_s, int world_size, bool force) {
  const double now = unix_time_now();
  if (last_step_ >= 0 && step > last_step_ && now > last_t_) {
    const double r = static_cast<double>(step - last_step_) / (now - last_t_);
    rate_ = rate_ == 0 ? r : 0.7 * rate_ + 0.3 * r;
  }
  if (step != last_step_) last_step_ = step, last_t_ = now;
  world_ = world_size;
  loss_ = loss;
  sps_ = samples_per_s;
  if (force)
    tb_.add_scalars(step, {{"train/loss", loss},
                           {"train/learning_rate", lr},
                           {"train/samples_per_second", samples_per_s},
                           {"cluster/world_size", static_cast<double>(world_size)}});
  progress_state ps;
  ps.step = step;
  ps.total = opts_.max_steps;
  ps.loss = loss;
  ps.samples_per_s = samples_per_s;
  ps.eta_s = rate_ > 0 && opts_.max_steps > step ? static_cast<double>(opts_.max_steps - step) / rate_ : (step >= opts_.max_steps ? 0 : -1);
  ps.tail = "world " + std::to_string(world_size);
  {
    std::lock_guard<std::mutex> lock(event_mu_);
    if (!last_event_.empty()) ps.tail += " | " + last_event_;
  }
  progress_.update(ps, force);
}

void run_observer::on_eval(int64_t step, const std::map<std::string, double>& metrics) {
  std::map<std::string, double> tagged;
  std::string line = "eval at step " + std::to_string(step) + ":";
  std::string short_line = "eval " + std::to_string(step);
  for (const auto& [k, v] : metrics) {
    tagged["eval/" + k] = v;
    char buf[64];
    std::snprintf(buf, sizeof buf, " %s=%.4f", k.c_str(), v);
    line += buf;
    short_line += buf;
  }
  tb_.add_scalars(step, tagged);
  note_event(short_line);
  progress_.log(line);
}

void run_observer::on_generation(uint64_t generation, int world_size, int64_t start_step) {
  world_ = world_size;
  tb_.add_scalars(start_step, {{"cluster/world_size", static_cast<double>(world_size)}, {"cluster/generation", static_cast<double>(generation)}});
  note_event("generation " + std::to_string(generation) + " (world " + std::to_string(world_size) + ")");
}

}  // namespace dtactor
