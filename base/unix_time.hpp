#pragma once
// Wall-clock time as journals and checkpoints record it.
#include <chrono>

namespace dtactor {

// Seconds since the Unix epoch (system clock), with fractions.
inline double unix_time_now() {
  using namespace std::chrono;
  return duration_cast<duration<double>>(system_clock::now().time_since_epoch()).count();
}

}  // namespace dtactor
