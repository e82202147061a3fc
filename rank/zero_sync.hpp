#pragma once
// ZeRO's parameter sync (comm/param_sync.hpp) for a generation: the
// parameter all-gather after each update (train.zero >= 1) and the
// clipping norm from the gradient shards (train.zero = 2), over the path
// the ranks' places allow, decided once and alike on every rank:
//   group          the world's process group (Gloo), everywhere
//   world segment  every rank on one host and the gradients through its
//                  segment: the all-gather and the norm's sum through it
//                  too, between the gradient exchange's steps (no loopback
//                  TCP)
//   host segments  several hosts, hierarchical, every host holding every
//                  shard between its ranks: the all-gather is a round of
//                  each host's segment (nothing a rank lacks is on another
//                  host); the norm over the group
// The collectives themselves are rank/zero.hpp's.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "comm/param_sync.hpp"

namespace dtactor {

class flat_adamw;
class grad_sync;
class shm_group;
struct exchange_plan;
struct shard_plan;

struct zero_sync_settings {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;  // the world's group
  bool sharded_norm = false;                  // the clipping norm from the shards, one allreduce (the step's commit)
  std::chrono::milliseconds timeout{30000};   // of each collective
  std::function<bool()> abandon;              // a newer generation replaces this one
  std::chrono::microseconds spin{0};          // cluster.spin_wait_us (the segments' waits)
  std::string backend = "gloo";               // the group's, for describe()
};

// The generation's strategy, after its reducer `sync` was built over
// `plan` (exchange_plan: the segments, the hosts); null when there is
// nothing to sync (no shards, no group, a world of one).
std::unique_ptr<param_sync> zero_sync_for(const grad_sync& sync, const exchange_plan& plan, flat_adamw& opt, const shard_plan* shards,
                                          zero_sync_settings s);

// Each path, for tests: over `s.pg`; through the world's segment `shm`;
// through this host's segment `shm` (null: alone on its host, it holds
// every shard) of the ranks `members`.
std::unique_ptr<param_sync> zero_sync_over_group(flat_adamw& opt, const shard_plan& shards, zero_sync_settings s);
std::unique_ptr<param_sync> zero_sync_over_segment(std::shared_ptr<shm_group> shm, flat_adamw& opt, const shard_plan& shards,
                                                   zero_sync_settings s);
std::unique_ptr<param_sync> zero_sync_within_hosts(std::shared_ptr<shm_group> shm, std::vector<int> members, flat_adamw& opt,
                                                   const shard_plan& shards, zero_sync_settings s);

}  // namespace dtactor
