#pragma once
// The job actor's bookkeeping as plain data and pure functions (no CAF, no
// clock reads): the ranks' step reports folded into completed steps, a
// recovery's accounting from its plan to the first step every rank of the
// new generation completed, and the verdict when every rank has finished.
// The actor feeds them its own clock's time; tests feed them any time.
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "job/events.hpp"
#include "actors/liveness.hpp"
#include "actors/membership.hpp"
#include "wire.pb.h"

namespace dtactor {

// The ranks' reports of one generation, folded per step.
class step_table {
 public:
  // Adds one rank's report. Returns the completed step once every rank of
  // the generation (`world_size` ranks) has reported that step; earlier steps that were
  // still incomplete are forgotten then (a rank's reports cover every step
  // since its previous one).
  std::optional<ev::step_completed> add(const pb::step_report& r, uint64_t generation, int32_t world_size);
  void clear() { rows_.clear(); }
  std::size_t pending() const { return rows_.size(); }

 private:
  struct row {
    int world = 0;
    int reports = 0;
    int steps = 1;  // steps the reports cover
    double loss_weighted = 0, loss_mean_weighted = 0;
    int64_t samples = 0;
    double max_step_s = 0;
    double allreduce_s = 0, exposed_s = 0, compute_s = 0, update_s = 0, gather_s = 0, pass_gather_s = 0;
    double lr = 0;
  };
  std::map<int64_t, row> rows_;
};

// A step report that closed DiLoCo windows (r.outer_steps() > 0), as the
// journal's outer_step: the last window's figures, the payload and the
// exchange per window. The job actor and `dtactor train` (world 1) alike.
ev::outer_step outer_step_of(const pb::step_report& r, uint64_t generation, int32_t world_size);

// A generation's accounting, from its plan to its first completed step.
struct recovery_record {
  uint64_t generation = 0;
  plan_cause cause = plan_cause::none;  // start and adopted are not recoveries
  bool drain = false;
  clock_time planned{};
  int64_t steps_before = 0;   // highest step completed by every rank when it was planned
  int64_t resumed_step = -1;  // highest step a rank reported READY at
  bool restored_logged = false;
  std::optional<ev::optimizer_source> optimizer;  // train.zero >= 1: the furthest source a rank reported
  uint64_t reshard_bytes = 0;
  int lost_workers = 0;                // ranks the world shrank by (a loss)
  std::optional<int64_t> window_steps;  // train.sync = diloco: the furthest window position a rank reported
  std::optional<int64_t> replayed_slices;  // ... and the slices of it the survivors train again
  // The slowest READY rank's plan-to-READY, drain (plan to its previous
  // generation's end), plan-to-group and agreement-and-state seconds (its
  // own clock); none before a READY.
  std::optional<double> ready_s;
  double drain_s = 0, group_s = 0, state_s = 0;
  int32_t spare_ranks = 0;  // READY ranks that were a node's warm spares
  bool done = false;
};

// The record for a new generation. `first` = no generation before it in
// this coordinator's life (then the cause is "start" unless it is a
// restart of a running job).
recovery_record begin_generation(uint64_t generation, bool first, plan_cause cause, bool drain, clock_time now, int64_t steps_before, int lost_workers = 0);

// A rank of the record's generation reported READY. Returns the one
// `checkpoint_restored` event of the generation, at the first rank that
// took its state from a peer or from disk.
std::optional<ev::checkpoint_restored> note_ready(recovery_record& rec, const pb::rank_status& s);

// Every rank of the record's generation completed `step`. The first call
// closes the record; for a generation after a failure it returns what the
// recovery cost (lost_steps: completed steps the generation did not resume
// from; duration: from the plan to now).
std::optional<ev::recovery_done> complete_generation(recovery_record& rec, int64_t step, int32_t world_size, clock_time now);

// The end of a job whose every rank reported FINISHED: finished at
// max_steps, stopped before it; digests_differ (and exit code 1) when the
// ranks' parameter digests differ. `digests`: global rank -> the digest it finished with.
ev::job_ended verdict(const std::map<int32_t, std::string>& digests, int64_t step, int64_t max_steps, uint64_t generation, int32_t world_size,
                      const std::map<std::string, double>& last_eval);

}  // namespace dtactor
