#pragma once
// Time the training step spends assembling its batch (data loading): the
// tasks time it where they gather samples, and whoever reports steps takes
// the sum since its last report. Process-wide (a process trains on one
// thread); lock-free, so timing costs ~50 ns per batch.
#include <atomic>
#include <chrono>
#include <cstdint>

namespace dtactor {

namespace detail {
inline std::atomic<int64_t>& data_wait_ns() {
  static std::atomic<int64_t> ns{0};
  return ns;
}
}  // namespace detail

// Seconds of data loading since the previous call (the first: since start).
inline double take_data_wait_s() { return static_cast<double>(detail::data_wait_ns().exchange(0)) * 1e-9; }

// Adds the time from construction to destruction to the data-loading time.
class data_wait_timer {
 public:
  data_wait_timer() : t0_(std::chrono::steady_clock::now()) {}
  ~data_wait_timer() {
    detail::data_wait_ns().fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count());
  }
  data_wait_timer(const data_wait_timer&) = delete;
  data_wait_timer& operator=(const data_wait_timer&) = delete;

 private:
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace dtactor
