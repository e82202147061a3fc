#pragma once
// What the pieces of a rank's generation share (rank/lifecycle.hpp): the
// worker's state kept across generations (rank_state), one generation's
// group and starting state as it runs (generation_run), and how a piece
// ends the generation (an outcome; a failure reported once, here).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "actors/rank_work.hpp"
#include "comm/bucket_buffers.hpp"
#include "comm/exchange.hpp"
#include "dtactor/config.hpp"
#include "dtactor/result.hpp"
#include "job/journal_events.hpp"
#include "job/modes.hpp"
#include "job/settings.hpp"
#include "model/shard_plan.hpp"
#include "rank/diloco_window.hpp"
#include "rank/outcome.hpp"
#include "wire.pb.h"

namespace dtactor {

struct group_request;

class training_state;
class sample_log;
class checkpoint_saver;
class sync_strategy;
class heal_transfer;
class local_peers;

using abandon_fn = std::function<bool()>;

std::chrono::steady_clock::time_point deadline_in(std::chrono::milliseconds d);
double now_s();  // steady clock seconds

// The element-wise MAX (SUM) of every rank's `words`, in place (same length on every rank).
status max_allreduce(c10d::ProcessGroup& pg, std::vector<int64_t>& words, std::chrono::steady_clock::time_point deadline, const abandon_fn& abandon,
                     const char* what);
status sum_allreduce(c10d::ProcessGroup& pg, std::vector<int64_t>& words, std::chrono::steady_clock::time_point deadline, const abandon_fn& abandon,
                     const char* what);

pb::rank_status status_of(pb::rank_status::state s, int rank, int local_rank, int64_t step, const std::string& detail);

// What the training thread keeps across generations.
struct rank_state {
  rank_state();
  ~rank_state();
  // The plan's config (train.threads fitted to this host), and the same
  // read once into the typed settings where it arrives (warm_up), with
  // the modes (settings.modes); the pieces read the settings.
  std::optional<config> cfg;
  job_settings settings;
  std::shared_ptr<training_state> state;
  // Groups of earlier generations: an abandoned collective may still run on
  // their threads, and a group's destructor waits for it. Kept until the
  // process ends (it ends with _exit).
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> parked;
  // The reducers' bucket buffers, from one generation's reducer to the next
  // (comm/bucket_buffers.hpp); filled at warm-up when the host has room.
  std::shared_ptr<bucket_buffers> buckets = std::make_shared<bucket_buffers>();
  bool injected = false;
  // Neither train.threads nor --threads-per-rank fixed the thread count:
  // each generation splits the machine's cores over the ranks it plans there.
  bool auto_threads = false;
  std::string module_digest;  // of the shipped module it loaded ("" = none shipped)
  int threads = 0;
  std::unique_ptr<checkpoint_saver> saver;  // made at warm-up
  std::unique_ptr<sync_strategy> sync;      // train.sync's, made at warm-up
  // train.zero >= 1: who holds which optimizer shard in this generation.
  std::optional<shard_plan> shards;
  // data.sample_log (null: off), and the step this rank last attempted:
  // (step, generation, global rank, world size).
  std::unique_ptr<sample_log> samples_log;
  struct attempt_id {
    int64_t step = -1;
    uint64_t gen = 0;
    int rank = -1, world = 0;
  } attempt;
  // The last generation this rank trained in, its global rank and world
  // size there (world 0: none yet).
  uint64_t trained_gen = 0;
  int trained_rank = -1, trained_world = 0;
  diloco_window window;  // train.sync = diloco
  // The step of the checkpoint this rank's state was read from (by it, or
  // by the root that sent it), -1: none. While the state is still at that
  // step, it is the checkpoint's: a generation abandoned after the read
  // (a newer plan came) leaves the next one starting from disk, not from
  // this rank's own.
  int64_t disk_step = -1;
  // checkpoint.defer_while_writing: the step a checkpoint fell due at that
  // is still owed (deferred while a rank's writer was busy), -1: none. It
  // outlives a generation that ends first: the next one's ranks agree on
  // it (the MAX over them, starting_state's agreement) and take it at
  // their first boundary where no writer is busy.
  int64_t owed_checkpoint = -1;

  // data.sample_log: the samples of the step this rank just applied (its
  // last forward_backward's); nothing when the log is off. `fragments`
  // (DiLoCo, a slice replayed to some fragments only): those. `samples`:
  // these instead of the last forward_backward's.
  status log_samples(int64_t step, uint64_t gen, int rank, int world, const std::vector<bool>& fragments = {},
                     const std::vector<int64_t>* samples = nullptr);
};

// One generation as the training thread runs it.
struct generation_run {
  generation_run(const pb::generation_plan& p, const rank_work_callbacks& c) : plan(p), cb(c) {}
  const pb::generation_plan& plan;
  const rank_work_callbacks& cb;
  uint64_t gen = 0;
  int local = 0;
  int rank = -1;
  int world = 0;
  double offered_at = 0;
  double drain_s = 0;  // from the plan to the previous generation's end (the boundary a drain switches at)
  double group_s = 0;  // from the plan to the group built (0 alone)
  std::chrono::milliseconds timeout{0};
  abandon_fn abandon_now;  // quit, or a newer plan without drain
  std::function<bool()> quitting, newer_plan_waiting;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;  // null when world == 1
  std::shared_ptr<const group_request> group;  // how pg was built (rank/group_builder): side groups are built alike
  c10::intrusive_ptr<c10d::ProcessGroup> transfer_pg;  // the state transfers' side group, once built (rank/group_builder transfer_group)
  std::shared_ptr<const local_peers> peers;  // who reads whose memory, once agreed (rank/group_builder local_peers_of)
  exchange_plan exchange;                     // how gradients travel (cluster.shm_allreduce: shared memory within hosts)
  std::string backend;
  ev::state_source source = ev::state_source::local;  // where the starting state came from
  int root = 0;                                       // global rank the state came from
  uint64_t transfer_bytes = 0;                        // state received from a peer
  double transfer_s = 0;
  uint64_t reshard_bytes = 0;                                  // optimizer shards and parameters moved (train.zero >= 1)
  ev::optimizer_source optimizer = ev::optimizer_source::own;  // where its optimizer shards came from
  // train.sync = diloco: steps this rank skipped to meet the furthest peer,
  // and the window's steps already taken (since the anchor) when it began.
  int64_t skipped_steps = 0, window_steps = 0;
  // ... and the slices of the window no survivor held, trained again by the
  // survivors before the next boundary (diloco_window::agree).
  int64_t replayed_slices = 0;
  // cluster.heal_while_training (rank/healing): the state's transfer
  // during the generation's first step, on the root and on the ranks
  // receiving it; ended with the generation.
  std::shared_ptr<heal_transfer> healing;

  void report_status(pb::rank_status::state s, int64_t step, const std::string& detail) const;
  // STATE_FAILED with `why`, unless the generation is being abandoned (a
  // newer plan, or quit): then that outcome, and nothing reported.
  generation_outcome failed(const std::string& why, int64_t step, pb::rank_status::failure_kind kind = pb::rank_status::FAILURE_UNSPECIFIED) const;
  // The checkpoint at `checkpoint_step` could not be loaded. `refused` (its
  // bytes do not check out, errc::corrupt_checkpoint, or it does not fit
  // the job): FAILURE_CHECKPOINT, and the coordinator marks it bad for the
  // job and plans from the previous one. Otherwise (the store unreachable,
  // an I/O error) a plain failure, which a new generation may get past.
  generation_outcome checkpoint_unusable(int64_t checkpoint_step, const std::string& why, bool refused, int64_t step) const;
};

// train.diloco_worker = host, and this rank's host is a worker of several
// ranks, synchronous over its shared-memory segment (else every rank is a
// worker of its own). The same on every rank of a host.
bool host_worker(const generation_run& g, const rank_state& rs);

}  // namespace dtactor
