#pragma once
// What happens after a step, decided in one place for `dtactor train` and the
// cluster rank: when to report, evaluate, checkpoint and compare parameter
// digests (each every N steps, and always at train.max_steps), and the one
// shape of an evaluation's report. No LibTorch here.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "job/settings.hpp"
#include "wire.pb.h"

namespace dtactor {

struct step_cadence {
  int64_t max_steps = 1;     // train.max_steps
  int64_t report_every = 1;  // train.log_every_steps
  int64_t eval_every = 0;    // eval.every_steps (0: only at the end)
  int64_t checkpoint_every = 0;  // checkpoint.every_steps (0: only at the end)
  int64_t digest_every = 0;  // cluster.digest_every_steps (0: only at the end)

  // Every `every` steps (never when every <= 0), and always at max_steps.
  bool due(int64_t every, int64_t step) const { return (every > 0 && step % every == 0) || step == max_steps; }
  bool report_due(int64_t step) const { return due(report_every, step); }
  bool eval_due(int64_t step) const { return due(eval_every, step); }
  bool checkpoint_due(int64_t step) const { return due(checkpoint_every, step); }
  bool digest_due(int64_t step) const { return due(digest_every, step); }
};

// From the job's settings (job/settings.hpp).
inline step_cadence step_cadence_of(const job_settings& s) {
  step_cadence c;
  c.max_steps = s.train.max_steps;
  c.report_every = s.train.log_every_steps;
  c.eval_every = s.eval.every_steps;
  c.checkpoint_every = s.checkpoint.every_steps;
  c.digest_every = s.cluster.digest_every_steps;
  return c;
}

// An evaluation at `step` as the coordinator and the journal see it.
inline pb::eval_report eval_report_of(int64_t step, const std::map<std::string, double>& metrics, const std::vector<std::string>& examples,
                                      double duration_s) {
  pb::eval_report r;
  r.set_step(step);
  for (const auto& [k, v] : metrics) (*r.mutable_metrics())[k] = v;
  for (const auto& ex : examples) r.add_examples(ex);
  r.set_duration_s(duration_s);
  return r;
}

}  // namespace dtactor
