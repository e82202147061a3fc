#include "app/coordinator_lease.hpp"

#include <unistd.h>

#include "base/printable.hpp"

namespace dtactor {

namespace {

using clock_type = std::chrono::steady_clock;

std::string describe(const lease_holder& h) {
  return printable(h.holder) + " (" + printable(h.address) + ", epoch " + std::to_string(h.epoch) + ")";
}

std::chrono::milliseconds renew_period(std::chrono::milliseconds ttl) { return std::max(ttl / 6, std::chrono::milliseconds(20)); }

// A standby sees the lease lapse at its first look a TTL after it first saw
// the holder's last heartbeat: looking more often than the holder renews
// takes over up to a renewal period sooner (the TTL still counts from after
// that renewal began, so the holder's safety is the same). One small read a
// look.
std::chrono::milliseconds standby_poll_period(std::chrono::milliseconds ttl) { return std::min(renew_period(ttl), std::chrono::milliseconds(100)); }

}  // namespace

result<std::unique_ptr<coordinator_lease>> coordinator_lease::take(const lease_settings& s, const std::function<void(const std::string&)>& say,
                                                                   int* code) {
  *code = 2;
  lease_options o;
  o.ttl = s.ttl;
  o.s3_endpoint = s.s3_endpoint;
  auto opened = open_leader_lease(s.where, o);
  if (!opened) return opened.err();
  auto lease = std::move(opened.value());
  bool said = false;
  while (!(s.stop_signal && s.stop_signal->load())) {
    const int64_t began = clock_type::now().time_since_epoch().count();
    auto claim = lease->try_acquire({0, s.holder, s.address});
    if (claim && claim->taken) {
      say("holds the job's lease at " + printable(s.where) + ", epoch " + std::to_string(claim->current.epoch));
      return std::unique_ptr<coordinator_lease>(new coordinator_lease(std::move(lease), s, say, claim->current.epoch, began));
    }
    if (!s.standby) {
      if (!claim) return claim.err();
      return make_error("the job's lease at " + printable(s.where) + " is held by " + describe(claim->current) +
                        ": another coordinator runs this job; add --standby to take over when it is gone");
    }
    if (!said) {
      say(claim ? "standing by: the job's lease is held by " + describe(claim->current) : "standing by: " + claim.message());
      said = true;
    }
    std::this_thread::sleep_for(standby_poll_period(s.ttl));  // nothing signals the lease's lapse
  }
  *code = 0;
  return make_error("stopped while standing by");
}

coordinator_lease::coordinator_lease(std::unique_ptr<leader_lease> lease, lease_settings s, std::function<void(const std::string&)> say,
                                     uint64_t epoch, int64_t taken_ns)
    : lease_(std::move(lease)), s_(std::move(s)), say_(std::move(say)), epoch_(epoch), last_renewed_ns_(taken_ns) {
  renewer_ = std::thread([this] { renew_loop(); });
}

coordinator_lease::~coordinator_lease() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (renewer_.joinable()) renewer_.join();
  (void)lease_->release();
}

std::chrono::nanoseconds coordinator_lease::since_renewed() const {
  return std::chrono::nanoseconds(clock_type::now().time_since_epoch().count() - last_renewed_ns_.load());
}

bool coordinator_lease::surely_held() const { return since_renewed() < s_.ttl / 2; }

void coordinator_lease::wait_until_held() const {
  if (surely_held()) return;
  std::unique_lock<std::mutex> lock(mu_);
  // The renewer renews, takes a lapsed lease back, or ends the process; a
  // stop signal ends the wait (the job cannot stop while its decisions wait).
  while (!surely_held()) {
    if (s_.stop_signal && s_.stop_signal->load()) stop_deciding("stopped while the job's lease was not held");
    renewed_.wait_for(lock, std::chrono::milliseconds(100));
  }
}

// A standby leads only after it saw the heartbeat unchanged for the TTL,
// watched from after the renewal that wrote it began. So while each
// renewal finishes within the TTL of the one before began, no standby can
// lead; a renewal late by up to half the TTL (a loaded machine) holds it
// still, and only deciding waits for it (wait_until_held). Later than the
// TTL, the lease is taken back only where no standby took it.
void coordinator_lease::renew_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, renew_period(s_.ttl), [this] { return stopping_; })) {
    lock.unlock();
    const int64_t began = clock_type::now().time_since_epoch().count();
    if (since_renewed() >= s_.ttl) {
      reclaim_after_lapse(began, "this coordinator was stopped or cut off for the lease's TTL");
    } else {
      auto r = lease_->renew();
      if (r && *r == renewal::deposed)
        stop_deciding("another coordinator took the job's lease (this one held epoch " + std::to_string(epoch_) + ")");
      if (since_renewed() >= s_.ttl)
        reclaim_after_lapse(began, "the job's lease was not renewed within its TTL" + (r ? std::string() : " (" + r.message() + ")"));
      else if (r)
        last_renewed_ns_ = began;
    }
    lock.lock();
    renewed_.notify_all();
  }
}

// Deciding waits meanwhile (surely_held is false). An error (the store
// unreachable from here) is said once and tried again at the next period;
// a standby that took the lease meanwhile deposes this one at the first
// try that gets through.
void coordinator_lease::reclaim_after_lapse(int64_t began, const std::string& why) {
  const uint64_t held = epoch_;
  auto r = lease_->reclaim();
  if (!r) {
    if (r.message() != reclaim_error_) say_(why + "; cannot take it back yet: " + r.message());
    reclaim_error_ = r.message();
    return;
  }
  reclaim_error_.clear();
  if (!*r) stop_deciding("another coordinator took the job's lease (this one held epoch " + std::to_string(held) + ")");
  epoch_ = **r;
  last_renewed_ns_ = began;
  say_(why + "; nobody took the lease meanwhile: holds it again at " + printable(s_.where) + ", epoch " + std::to_string(**r));
}

void coordinator_lease::give_up(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (renewer_.joinable() && renewer_.get_id() != std::this_thread::get_id()) renewer_.join();  // its renewal in flight ends first
  (void)lease_->release();
  stop_deciding(why + "; let the job's lease go (epoch " + std::to_string(epoch_) + ") for a standby to lead");
}

// Written straight to fd 2 (the console's queue may never drain); the
// actors, the bridge and the store end with the process.
void coordinator_lease::stop_deciding(const std::string& why) {
  const std::string line = "dtactor: coordinator: stops deciding: " + why + "\n";
  (void)!::write(2, line.data(), line.size());
  ::_exit(3);
}

}  // namespace dtactor
