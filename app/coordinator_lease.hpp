#pragma once
// The coordinator's hold on the job's leader lease (--lease WHERE;
// storage/leader_lease.hpp). It is taken before the coordinator starts
// anything (its run directory, journal, port): a second coordinator either
// stops with one line naming the holder, or, with --standby, waits until
// the holder lets the lease lapse (its machine lost) or releases it, then
// starts as a restarted coordinator does, adopting the running generation
// from the nodes. Held, it is renewed on a thread of its own about every
// sixth of the TTL. It decides only while its last renewal began less than
// half the TTL ago (surely_held); past that, deciding waits for the next
// renewal (wait_until_held), so a loaded machine delays decisions, never
// drops them. When no renewal succeeded within the TTL (the process was
// stopped that long, or a renewal finished too late), a standby may lead
// by now: the lease is taken back only where nobody else took it meanwhile
// (leader_lease::reclaim), under the epoch that gives, and deciding goes
// on; when another coordinator holds a newer epoch, this process stops
// deciding at once: one line, exit code 3.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "dtactor/result.hpp"
#include "storage/leader_lease.hpp"

namespace dtactor {

struct lease_settings {
  std::string where;  // --lease: etcd://HOST:PORT[/PREFIX], s3://BUCKET/PREFIX or a directory on a shared file system
  std::string s3_endpoint;  // s3://: checkpoint.s3_endpoint (empty: AWS_ENDPOINT_URL, else AWS)
  bool standby = false;
  std::chrono::milliseconds ttl{1500};
  std::string holder;   // this coordinator's id (host:pid)
  std::string address;  // where nodes reach it (--listen)
  const std::atomic<int>* stop_signal = nullptr;  // standing by ends on a stop signal
};

class coordinator_lease {
 public:
  // Takes the lease (standing by while another holds it, with --standby);
  // `say` gets the lines an operator should see. Error: one line (exit 2:
  // held by another without --standby, or a place that cannot hold a
  // lease); a standby stopped by a signal returns nothing (exit 0).
  static result<std::unique_ptr<coordinator_lease>> take(const lease_settings& s, const std::function<void(const std::string&)>& say, int* code);
  ~coordinator_lease();  // stops renewing and releases the lease

  // The epoch this coordinator's decisions carry (it grows when a lapsed
  // lease is taken back). Any thread.
  uint64_t epoch() const { return epoch_.load(); }
  // Whether this coordinator may still decide: its last renewal is less
  // than half the TTL old. A process stopped or cut off for longer (a
  // standby may lead by now) changes nothing from the moment it runs
  // again, before its renewer finds out and ends it. Any thread.
  bool surely_held() const;
  // Returns once surely_held(): at once, or after the next renewal, or
  // once a lapsed lease was taken back; the process ends (exit 3) when
  // another coordinator took it, or on a stop signal meanwhile. Any
  // thread; what a decision calls.
  void wait_until_held() const;
  // Lets the lease go at once (its renewals end, the lease is released, so
  // a standby may take it at its next look) and stops deciding: one line,
  // exit code 3. For a leader that lost every node to silence while its
  // lease still holds (cut off from the nodes, not from the lease): the
  // standby the nodes can reach leads instead. Any thread.
  [[noreturn]] void give_up(const std::string& why);

 private:
  coordinator_lease(std::unique_ptr<leader_lease> lease, lease_settings s, std::function<void(const std::string&)> say, uint64_t epoch,
                    int64_t taken_ns);
  void renew_loop();
  void reclaim_after_lapse(int64_t began, const std::string& why);
  [[noreturn]] static void stop_deciding(const std::string& why);
  std::chrono::nanoseconds since_renewed() const;

  std::unique_ptr<leader_lease> lease_;
  lease_settings s_;
  std::function<void(const std::string&)> say_;
  std::atomic<uint64_t> epoch_;
  std::string reclaim_error_;  // the renewer's: the last reclaim's error, said once
  std::atomic<int64_t> last_renewed_ns_;  // steady clock: when the last renewal (or the take) began
  mutable std::mutex mu_;
  std::condition_variable cv_;                // the renewer's period; the destructor ends it
  mutable std::condition_variable renewed_;  // each renewal, for wait_until_held
  bool stopping_ = false;
  std::thread renewer_;
};

}  // namespace dtactor
