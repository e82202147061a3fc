#include "actors/spare_pool.hpp"

#include <algorithm>

namespace dtactor {

void spare_pool::resize(int32_t n, clock_time now) {
  size_ = std::max(0, n);
  if (static_cast<int32_t>(procs_.size()) < size_) start_at(now + opts_.start_delay);
}

int32_t spare_pool::warm() const {
  return static_cast<int32_t>(std::count_if(procs_.begin(), procs_.end(), [](const spare_process& p) { return p.warm; }));
}

int32_t spare_pool::due(clock_time now) const {
  if (!next_start_ || now < *next_start_) return 0;
  return std::max(0, size_ - static_cast<int32_t>(procs_.size()));
}

void spare_pool::started(int32_t pid, clock_time now) {
  spare_process p;
  p.pid = pid;
  p.last_seen = now;
  procs_.push_back(std::move(p));
  if (static_cast<int32_t>(procs_.size()) >= size_) next_start_.reset();
}

void spare_pool::start_failed(clock_time now) {
  ++ends_in_a_row_;
  auto d = opts_.backoff_initial;
  for (uint32_t i = 1; i < ends_in_a_row_ && d < opts_.backoff_max; ++i) d *= 2;
  next_start_ = now + std::min(d, opts_.backoff_max);
}

void spare_pool::training(clock_time now) {
  if (ends_in_a_row_ == 0 && static_cast<int32_t>(procs_.size()) < size_) start_at(now);
}

spare_process* spare_pool::by_pid(int32_t pid) {
  for (auto& p : procs_)
    if (p.pid == pid) return &p;
  return nullptr;
}

spare_process* spare_pool::by_peer(const std::string& peer) {
  if (peer.empty()) return nullptr;
  for (auto& p : procs_)
    if (p.peer == peer) return &p;
  return nullptr;
}

void spare_pool::warmed(spare_process& p) {
  p.warm = true;
  ends_in_a_row_ = 0;
}

std::optional<spare_process> spare_pool::take(clock_time now) {
  auto it = std::find_if(procs_.begin(), procs_.end(), [](const spare_process& p) { return p.warm; });
  if (it == procs_.end()) return std::nullopt;
  spare_process p = std::move(*it);
  procs_.erase(it);
  start_at(now + opts_.start_delay);
  return p;
}

bool spare_pool::exited(int32_t pid, clock_time now) {
  auto it = std::find_if(procs_.begin(), procs_.end(), [pid](const spare_process& p) { return p.pid == pid; });
  if (it == procs_.end()) return false;
  procs_.erase(it);
  start_failed(now);
  return true;
}

void spare_pool::credit_pause(clock_duration pause, clock_time now) {
  for (auto& p : procs_) p.last_seen = dtactor::credit_pause(p.last_seen, pause, now);
}

void spare_pool::start_at(clock_time t) { next_start_ = next_start_ ? std::min(*next_start_, t) : t; }

}  // namespace dtactor
