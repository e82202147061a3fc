#pragma once
// A node's warm spare rank processes (cluster.spare_ranks, --spares): rank
// processes started without a local rank, warmed up as a rank is (the
// job's config: LibTorch loaded, the model built, the data opened), then
// waiting. When a rank process of the node exits, the node agent hands its
// slot to the oldest warm spare (spare_slot), reports the exit with
// spare_takes_over, and the coordinator plans the spare in at once; the
// pool is refilled in the background, once the node's ranks report steps
// again (or `start_delay` later), so that a new spare's start does not
// compete with the recovery for the cores.
//
// Plain bookkeeping, no CAF: the node agent (actors/node_agent.cpp) starts,
// stops and talks to the processes, and feeds it its clock's time.
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "actors/liveness.hpp"

namespace dtactor {

struct spare_process {
  int32_t pid = -1;
  std::string peer;        // its routing id on the ranks' link, once it said hello
  bool warm = false;       // reported STATE_IDLE after its warm-up: it may take a slot
  clock_time last_seen{};  // started, its hello, heartbeats
};

struct spare_pool_options {
  // Missing spares start this long after they went missing (a takeover,
  // the node's registration) when no step report came before.
  std::chrono::milliseconds start_delay{2000};
  // A spare that ended while waiting (killed, crashed, a failed warm-up)
  // is started again after initial * 2^(ends in a row - 1), at most max.
  std::chrono::milliseconds backoff_initial{100};
  std::chrono::milliseconds backoff_max{5000};
};

class spare_pool {
 public:
  explicit spare_pool(spare_pool_options o = {}) : opts_(o) {}

  // Spares to keep (0: none). Missing ones start `start_delay` from `now`
  // (or at the next step report).
  void resize(int32_t n, clock_time now);
  int32_t size() const { return size_; }
  int32_t warm() const;
  const std::vector<spare_process>& processes() const { return procs_; }

  // How many spares to start at `now` (0 before their start time).
  int32_t due(clock_time now) const;
  // One was started as `pid`.
  void started(int32_t pid, clock_time now);
  // A start failed: tried again after the backoff.
  void start_failed(clock_time now);
  // The node's ranks reported steps: the recovery (or the job's start) is
  // over, and missing spares start now, unless they back off from failures.
  void training(clock_time now);

  spare_process* by_pid(int32_t pid);
  spare_process* by_peer(const std::string& peer);
  // Its warm-up is done (STATE_IDLE).
  void warmed(spare_process& p);
  // The oldest warm spare, out of the pool (a slot's process now); none
  // when no spare is warm. Its place is started `start_delay` from `now`
  // (or at the next step report).
  std::optional<spare_process> take(clock_time now);
  // A process ended: true when it was a waiting spare (out of the pool, its
  // place started again after the backoff).
  bool exited(int32_t pid, clock_time now);
  // The agent's own stall, not the spares' silence (pause_tracker).
  void credit_pause(clock_duration pause, clock_time now);

 private:
  void start_at(clock_time t);

  spare_pool_options opts_;
  int32_t size_ = 0;
  std::vector<spare_process> procs_;  // oldest first
  std::optional<clock_time> next_start_;
  uint32_t ends_in_a_row_ = 0;  // spares that ended while waiting, since one last warmed up
};

}  // namespace dtactor
