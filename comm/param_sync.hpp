#pragma once
// What a sharded optimizer (ZeRO, train.zero >= 1) adds to a data-parallel
// step beside the gradient exchange: the clipping norm from the ranks'
// gradient shards (train.zero = 2) and, after the update, the parameters
// the other ranks stepped (FSDP's unshard after the optimizer step). One
// strategy a generation, chosen once from where the ranks are
// (rank/zero_sync.hpp: over the group, through the world's segment, within
// each host) and owned by the reducer (grad_sync::set_parameter_sync), as
// its exchange is; training_state's step asks it (model/trainer.hpp).
// Runs on the training thread; every rank of the group calls it alike.
#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

class param_sync {
 public:
  virtual ~param_sync() = default;
  // The clipping norm comes from global_norm() (this rank holds only its
  // shards' summed gradients), not from the full gradients.
  virtual bool sharded_norm() const = 0;
  // The global gradient norm (a collective); called only when
  // sharded_norm(). When it fails, nothing was updated.
  virtual result<double> global_norm() = 0;
  // After the optimizer stepped this rank's shards: the other ranks'
  // updated parameters. When it fails the step has advanced, and the other
  // parameters may be a mix of two steps (training_state::params_mixed).
  virtual status gather() = 0;
  // How it runs, for the rank's READY line ("through shared memory").
  virtual std::string describe() const = 0;

  // train.zero = 3 (rank/zero3.hpp), where parameters are gathered a unit
  // at a time during forward and backward; nothing to do at other levels.
  // Whether this step's gathers completed (checked after the gradient
  // exchange; when not, nothing was updated).
  virtual status gathered() { return {}; }
  // One forward and backward's gathers without computing: a rank with
  // fewer micro-batches than another makes up the difference first.
  virtual void idle_pass() {}
  // Whether forward and backward make collectives of their own (then
  // every rank must make as many passes: idle_pass).
  virtual bool gathers_in_passes() const { return false; }
  // Seconds forward and backward spent in gathers and releases since the
  // last call (the wall time their gates took, compute waiting on them).
  virtual double take_pass_gather_s() { return 0; }
};

}  // namespace dtactor
