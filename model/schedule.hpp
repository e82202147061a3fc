#pragma once
// Learning-rate schedule: linear warm-up from 0 to the peak, then cosine
// decay to min_lr at max_steps. A pure function of the step, so resuming
// needs no schedule state beyond the step itself.
#include <cstdint>

namespace dtactor {

struct lr_schedule {
  double peak_lr = 1e-3;
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  int64_t max_steps = 1;

  // Learning rate used for optimizer step `step` (0-based).
  double at(int64_t step) const;
};

}  // namespace dtactor
