#pragma once
// ZeRO-1 across a generation's group (train.zero = 1): the collectives a
// sharded optimizer needs (model/shard_plan for who holds what).
//
// - gather_params: after each rank updated the parameters of the shards it
//   holds, every shard's primary sends them to all (an all-gather in blocks,
//   bounded extra memory).
// - reshard_optimizer: at a generation's start, each rank ends up holding the
//   moments of its shards under the new plan, taken from whoever holds them
//   at the agreed step (a survivor's own copy, a replica, or the rank that
//   loaded a checkpoint), point to point; then, when any rank says its
//   parameters are a mix (its last all-gather failed after it stepped its
//   own shards), every parameter is broadcast from a holder of its shard. When some elements are held by
//   nobody (both holders of a shard lost at once), nothing changes and the
//   result says which: the caller falls back to a checkpoint.
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/shm_group.hpp"
#include "dtactor/result.hpp"
#include "model/shard_plan.hpp"

namespace c10d {
class ProcessGroup;
}

namespace dtactor {

class flat_adamw;
class shm_group;
class local_peers;
struct p2p_waits;
class training_state;
struct zero2_grads;

// train.zero = 2, at a generation's start before the state agreement: a
// step whose gradient-norm allreduce completed on some ranks (they stepped
// their shards) and failed on others (a peer died inside the collective) is
// finished by the others, from the gradient shards they kept and the norm
// the first ones clipped with, so that no shard is left a step behind its
// holders' peers (which would lose it with a dead node's replica). Ranks
// exchange (step, norm known, norm) in an all-gather; a rank one step behind
// the highest with an interrupted step finishes it, any other drops what it
// kept. Returns whether this rank finished a step.
result<bool> finish_interrupted_step(c10d::ProcessGroup& pg, training_state& state, std::chrono::milliseconds timeout,
                                     const std::function<bool()>& abandon);

// train.zero = 2: what grad_sync needs to reduce-scatter the gradients into
// `opt`'s gradient windows under `plan` (every rank's held ranges).
std::shared_ptr<const zero2_grads> zero2_of(flat_adamw& opt, const shard_plan& plan);
// The global gradient norm of sharded gradients (model/grad_norm's): each
// rank computes the norm's ranges of the shard it is the primary of, one
// allreduce of every range's value (zeros but the owner's) gives every rank
// all of them, added in index order: the bits of the whole gradient's norm.
result<double> global_grad_norm(c10d::ProcessGroup& pg, flat_adamw& opt, const shard_plan& plan, std::chrono::milliseconds timeout,
                                const std::function<bool()>& abandon);

status gather_params(c10d::ProcessGroup& pg, flat_adamw& opt, const shard_plan& plan, std::chrono::milliseconds timeout,
                     const std::function<bool()>& abandon, int64_t block_elements = 4 << 20);

// The same two collectives through the segment of a world whose ranks all
// share one host (the gradient exchange's, grad_sync over shared memory,
// called between its steps: rounds over the segment's ring, every rank
// writes its part into its region and reads every rank's; the all-gather in
// rounds of half the ring). Gloo would move
// them through loopback TCP, in the kernel, on the cores that compute: the
// all-gather is every parameter, every step. Results are the same bits on
// every rank (the norm's per-range values, exchanged in rounds of half the
// ring, are added in index order).
// shm_fits: the parameters are all float32 and the plan is the segment's world.
bool shm_fits(const shm_group& shm, const flat_adamw& opt, const shard_plan& plan);
// Every parameter of the plan's index space is float32 (what the segments carry).
bool params_float32(const flat_adamw& opt, const shard_plan& plan);
status gather_params_shm(shm_group& shm, flat_adamw& opt, const shard_plan& plan, std::chrono::milliseconds timeout,
                         const std::function<bool()>& abandon, std::chrono::microseconds spin);

// Several hosts (the hierarchical exchange): when every host's ranks hold
// every shard between them (2 hosts with two holders a shard: each host
// holds the primaries of its ranks and replicas of the other's), a rank
// needs nothing from another host after the update, and the all-gather is
// a round of the host's segment instead of Gloo across all ranks (which
// would send every shard across the link to ranks that hold it already).
// `hosts`: every host's global ranks (exchange_plan::host_groups), alike on every
// rank, so every rank decides alike. A host of one rank covers every shard
// only when that rank holds them all: it then has nothing to gather.
bool hosts_cover_every_shard(const shard_plan& plan, const std::vector<std::vector<int>>& hosts);
// The segment `shm` of this host's ranks `members` (global ranks, in the
// segment's order): each shard some of them lacks is written once, by its
// primary when it is here, else by the first of them holding it, and read
// by those lacking it. With the world's segment this is gather_params_shm.
// `copies` (train.precision = bf16 at zero = 3): the bf16 copies the
// module computes with move (through the float slots, exactly), not the
// masters.
status gather_params_host(shm_group& shm, const std::vector<int>& members, flat_adamw& opt, const shard_plan& plan,
                          std::chrono::milliseconds timeout, const std::function<bool()>& abandon, std::chrono::microseconds spin,
                          bool copies = false);

// Who sends what in a host's parameter all-gather: each shard some member
// lacks comes from one member that holds it (its primary when that is
// here, else the first holder in the segment's order); a member's stream is
// the shards it provides, back to back.
struct host_streams {
  std::vector<int> provider;    // per shard: the member (index in `members`) that sends it, -1: nobody needs it
  std::vector<int64_t> at;      // per shard: where it starts in its provider's stream
  std::vector<int64_t> stream;  // per member: its stream's length
};

// gather_params_host in two halves, so that a gather can be started ahead
// of its use (train.zero = 3's next unit, while the current one computes):
// publish() writes this rank's pieces into the segment and publishes them,
// collect() waits for the others' and reads them. In rounds of half the
// ring; with every round published before any is read, which only fits
// when there is one round (ahead()).
class host_param_gather {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  // Error: members that are not the segment's, or a shard some member lacks
  // that none holds.
  static result<host_param_gather> make(shm_group& shm, std::vector<int> members, flat_adamw& opt, shard_plan plan, bool copies);
  // One round or none: publish() may run any time before collect().
  bool ahead() const { return longest_ <= block_; }
  // Floats of the ring its rounds reserve at once when ahead().
  int64_t ring_floats() const;
  status publish(time_point deadline, const std::function<bool()>& abandon, std::chrono::microseconds spin);
  status collect(time_point deadline, const std::function<bool()>& abandon, std::chrono::microseconds spin);
  // Both halves a round at a time, each round waiting up to `timeout`.
  status run(std::chrono::milliseconds timeout, const std::function<bool()>& abandon, std::chrono::microseconds spin);

 private:
  host_param_gather(shm_group& shm, std::vector<int> members, flat_adamw& opt, shard_plan plan, bool copies, host_streams streams);
  status publish_round(int64_t off, time_point deadline, const std::function<bool()>& abandon, std::chrono::microseconds spin);
  status collect_round(time_point deadline, const std::function<bool()>& abandon, std::chrono::microseconds spin);
  // Shard s's elements in the round at `off`, as [x, y) of its provider's stream.
  std::pair<int64_t, int64_t> piece(int s, int64_t off) const;

  shm_group* shm_;
  std::vector<int> members_;
  flat_adamw* opt_;
  shard_plan plan_;
  bool copies_;
  host_streams streams_;
  int64_t longest_ = 0, block_ = 1;
  struct round {
    int64_t off = 0;  // in the streams
    shm_group::region g;
  };
  std::deque<round> published_;  // published, not yet read (oldest first)
};
result<double> global_grad_norm_shm(shm_group& shm, flat_adamw& opt, const shard_plan& plan, std::chrono::milliseconds timeout,
                                    const std::function<bool()>& abandon, std::chrono::microseconds spin);

struct reshard_result {
  bool complete = true;                  // false: `missing` held by nobody; the optimizer is unchanged
  std::string missing;                   // "elements [a, b)"
  uint64_t bytes_in = 0, bytes_out = 0;  // moved by this rank (moments and parameters)
  uint64_t moments_in = 0;               // of bytes_in: optimizer moments this rank did not hold
  double seconds = 0;
};
// reshard_optimizer's moments in two halves, for a reshard while the
// generation's first step trains (rank/healing, at zero = 1 or 2, no
// parameter a mix of two steps; every rank holds every parameter in
// float32, or every bf16 copy with its shards' masters):
// - plan_reshard, on the generation's thread: who holds what (the one
//   all-gather on `pg`), the new windows (flat_adamw::shard; the old ones
//   stay, retired, until flat_adamw::drop_retired), and every move's tensor,
//   made dense now, so that nothing but the moves' sends and receives
//   touches the optimizer while they run. When some elements are held by
//   nobody the optimizer is unchanged (`complete` false, `missing` says
//   which).
// - run_moves, on any thread: every send and receive started at once on
//   the transfer group (comm/peer_moves: between ranks of one host that
//   `local` says read each other, through memory), then completed, the
//   receives first; `waits` issues and waits for the group's work.
// Until the moves are done the update must not run (the new windows are
// not all filled) and the retired windows must stay (they are sent).
struct reshard_move {
  torch::Tensor t;  // a receive's view into a new window, or a send's part of a retired one
  int peer = -1;
  int tag = 0;
  bool send = false;
};
struct reshard_plan {
  reshard_result totals;  // complete, missing and the bytes; seconds: the plan's
  std::vector<reshard_move> moves;
};
// `masters` (bf16 from zero = 1, sharded masters): a newly held
// segment's float32 masters move with its moments.
result<reshard_plan> plan_reshard(c10d::ProcessGroup& pg, flat_adamw& opt, const shard_plan& next, bool holds_current, std::chrono::milliseconds timeout,
                                  const std::function<bool()>& abandon, int tag_base, bool masters = false);
status run_moves(c10d::ProcessGroup& pg, const std::vector<reshard_move>& moves, const local_peers& local, const p2p_waits& waits);

// `holds_current`: this rank's moments are those of the agreed step (false
// for a rank that joined or fell behind: it receives everything it needs).
// `params_mixed`: this rank's last parameter all-gather failed.
// `params_everywhere` (train.zero = 3, where a rank keeps only its shards'
// parameters and these, the parameters of no unit): each rank gets the
// parameters of the shards it newly holds point to point, as the moments,
// and these by broadcast, and nothing else (the repair is not needed: a
// holder of a shard's moments holds its current parameters).
// `local`: the moments' moves between ranks that read each other go
// through memory (run_moves); null: all over `pg`.
result<reshard_result> reshard_optimizer(c10d::ProcessGroup& pg, flat_adamw& opt, const shard_plan& next, bool holds_current, bool params_mixed,
                                         std::chrono::milliseconds timeout, const std::function<bool()>& abandon,
                                         const std::vector<std::pair<int64_t, int64_t>>* params_everywhere = nullptr,
                                         const local_peers* local = nullptr);

}  // namespace dtactor
