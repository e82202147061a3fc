#include "model/schedule.hpp"

#include <algorithm>
#include <cmath>

namespace dtactor {

double lr_schedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) return peak_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, max_steps - warmup_steps);
  const double progress = std::clamp(static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps), 0.0, 1.0);
  return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace dtactor
