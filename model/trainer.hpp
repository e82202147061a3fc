#pragma once
// The training engine of one process: AdamW with warm-up + cosine schedule,
// gradient clipping and accumulation, optional bf16 autocast and activation
// checkpointing, evaluation, state as checkpoint sections (exact resume). No
// I/O beyond reading data: the `train` command and the cluster rank
// (rank/) drive it.
//
// The step is split so that a data-parallel engine can put an allreduce
// between the two halves: forward_backward() accumulates this process's share
// of the gradient of the global-batch mean loss; apply_update() clips and
// steps the optimizer.
#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "checkpoint.pb.h"
#include "dtactor/config.hpp"
#include "dtactor/result.hpp"
#include "dtactor/task.hpp"
#include "model/data_order.hpp"
#include "model/diloco.hpp"
#include "model/flat_adamw.hpp"
#include "model/schedule.hpp"
#include "job/job_config.hpp"

namespace dtactor {

class journal;
class checkpoint_store;
class grad_sync;

// The model, optimizer and data order of one process; no I/O of its own.
class training_state {
 public:
  // Seeds LibTorch with train.seed, builds the task (loading data) and optimizer.
  static result<std::unique_ptr<training_state>> create(const config& cfg);

  // Accumulates the gradient of (sum of the samples' losses) / global batch,
  // in micro-batches of train.micro_batch_size. Returns the loss sum. With a
  // `sync`, it is armed right before the last micro-batch's backward, so that
  // gradient buckets are allreduced while that backward runs (the caller
  // still calls sync->finish()).
  // `divisor` > 0 divides the loss sum by it instead of the global batch
  // (DiLoCo's inner steps: the mean over this worker's own samples).
  double forward_backward(const std::vector<int64_t>& samples, int64_t step, int rank = 0, grad_sync* sync = nullptr, double divisor = 0);
  // Clips, sets the scheduled learning rate, steps AdamW, zeroes gradients,
  // and advances step(). Returns the gradient norm before clipping.
  // With `global_norm` (ZeRO-2: the norm of gradients sharded across the
  // ranks, worked out by the caller), clips to that norm instead.
  double apply_update(std::optional<double> global_norm = std::nullopt);
  // Drops whatever gradients were accumulated (a partial step).
  void zero_grad();

  // data.sample_log: while on, forward_backward() keeps the sample indices it
  // passes to the task's loss_sum (every micro-batch, in order) until the
  // next forward_backward(): recorded_samples(). Off (the default): nothing
  // is copied.
  void record_samples(bool on) {
    record_samples_ = on;
    recorded_.clear();
  }
  const std::vector<int64_t>& recorded_samples() const { return recorded_; }

  // One whole step in a single process. Returns the mean loss.
  double train_step();

  // One data-parallel step of `rank` in a world of `world` ranks; every rank
  // calls it for the same step() with a grad_sync over the same group. This
  // rank computes its data_order::rank_slice, the buckets are summed across
  // ranks while backward runs, then apply_update() steps on the global-batch
  // mean gradient. On error (a failed or timed-out collective) the optimizer
  // has not stepped and step() is unchanged.
  struct dp_step {
    double loss_sum = 0;                    // this rank's samples only
    int64_t samples = 0;                    // this rank's share of the global batch
    double grad_norm = 0;                   // of the global gradient, before clipping
    double compute_s = 0;                   // forward + backward (including overlapped allreduce)
    double update_s = 0;                    // clip + optimizer (+ gather)
    double gather_s = 0;                    // of update_s: the parameter all-gather (train.zero >= 1)
    double allreduce_s = 0, exposed_s = 0;  // see grad_sync_timing
    int buckets = 0, launched_in_backward = 0;
  };
  // A sharded optimizer (ZeRO) syncs through the reducer's parameter sync
  // (grad_sync::parameter_sync, comm/param_sync.hpp): its global norm
  // (train.zero = 2) clips, and its gather runs after the optimizer stepped
  // the shards this rank holds, to bring the others' parameters; when the
  // gather fails, step() has advanced (this rank's shards are the next
  // step's) and params_mixed() says the other parameters may be a mix of
  // two steps; when the norm fails, nothing was updated.
  // `divisor`: what the loss is divided by (0 = the global batch).
  result<dp_step> train_step_dp(int rank, int world, grad_sync& sync, double divisor = 0);
  // train.diloco_worker = host: one inner step of a worker made of the
  // ranks `host_ranks` (global ranks, this one among them): each its slice
  // of the step's global batch, the gradients summed over `host` (the
  // host's reducer), the mean loss of the host's samples, clipped by that
  // gradient's norm; every rank of the host steps alike. No collective
  // beyond the host.
  result<dp_step> inner_step_host(int rank, int world, grad_sync& host, const std::vector<int>& host_ranks);
  // train.sync = diloco (model/diloco.hpp): one inner step of this worker,
  // `rank` of `world`: its data_order::rank_slice of the step's global
  // batch, the gradient of its own mean loss, clipped by its own norm, its
  // own AdamW. No collective.
  result<dp_step> inner_step(int rank, int world);
  // train.sync = diloco, a lost worker's slice trained again: an inner step
  // on `step`'s slice `rank` of `world` (its samples, its dropout seed, the
  // learning rate of that step), applied to this worker's parameters without
  // moving step(). No collective.
  // Streaming: `fragments` (one flag per fragment; empty = all) says which
  // fragments the slice is owed to (those whose last pseudo-gradient was
  // taken before `step`); the others' parameters and moments are left as
  // they were (an outer step already took that slice into them).
  result<dp_step> replay_slice(int64_t step, int rank, int world, const std::vector<bool>& fragments = {});
  // train.diloco_worker = host: the same, by the ranks of a host together:
  // this rank (`part` of the host's `parts` ranks) computes its part of the
  // slice's samples, the host's reducer `host` sums the gradients (the
  // slice's mean), and every rank of the host applies the same update.
  result<dp_step> replay_slice_host(int64_t step, int rank, int world, int part, int parts, grad_sync& host,
                                    const std::vector<bool>& fragments = {});
  // The outer step at a boundary (outer().due(step())): every worker's
  // pseudo-gradient summed through `sync` (its control words too), then the
  // Nesterov step; every worker then holds the same parameters. On error
  // nothing changed (the next generation redoes the boundary). Not
  // streaming: the one fragment, without overlap.
  struct outer_step_result {
    double pseudo_grad_norm = 0;  // of the workers' average
    double exchange_s = 0, exposed_s = 0, update_s = 0;
    int64_t payload_bytes = 0;  // this worker's pseudo-gradient as handed to the exchange (fp32)
    int64_t inner_steps = 0;    // steps of the window it closes (streaming: of its fragment)
    size_t fragment = 0;
    bool landed = false;  // false: launched, in flight (outer_land later)
  };
  result<outer_step_result> outer_step(grad_sync& sync);
  // Streaming (model/diloco.hpp): fragment f's pseudo-gradient goes out on
  // `sync` (that fragment's reducer, its control words too). `overlap`: the
  // exchange is left in flight and lands with outer_land() after later
  // inner steps; otherwise it is waited for and lands now. On error nothing
  // changed and nothing is in flight.
  result<outer_step_result> outer_launch(size_t f, grad_sync& sync, bool overlap);
  // The exchange in flight lands: waited for on `sync` (its fragment's
  // reducer), then its fragment's outer step.
  result<outer_step_result> outer_land(grad_sync& sync);
  bool diloco() const { return outer_ != nullptr; }
  outer_optimizer& outer() { return *outer_; }
  // DiLoCo: move to `step` without training (a worker behind its peers
  // after a new generation skips the steps they already took).
  void skip_to(int64_t step);

  // A `gather` failed since the last clear: parameters outside this rank's
  // shards may be a mix of two steps (rank/zero repairs them).
  bool params_mixed() const { return params_mixed_; }
  void clear_params_mixed() { params_mixed_ = false; }

  // ZeRO-2: when the gradient-norm allreduce failed on this rank, its
  // gradient shards (the whole world's sum, the exchange having completed)
  // are kept: a collective can complete on some ranks and fail on others
  // when a peer dies in it, and the ranks that completed it stepped their
  // shards. The next generation finishes the step here with their norm
  // (rank/zero: finish_interrupted_step) or drops it.
  bool has_interrupted_step() const { return interrupted_at_ && *interrupted_at_ == step_; }
  // The global gradient norm this rank clipped with to reach step(), when it
  // stepped itself (not when step() came with a loaded or received state).
  std::optional<double> norm_of_last_step() const {
    if (last_norm_ && last_norm_->first == step_) return last_norm_->second;
    return std::nullopt;
  }
  // Steps this rank's shards with the kept gradients clipped to `norm`;
  // the other parameters stay a step behind (params_mixed()).
  void finish_interrupted_step(double norm);
  void drop_interrupted_step();

  eval_result evaluate();

  int64_t step() const { return step_; }
  double lr_at(int64_t step) const { return schedule_.at(step); }
  const config& cfg() const { return cfg_; }
  task& the_task() { return *task_; }
  const data_order& order() const { return *order_; }
  std::vector<torch::Tensor> gradients();

  // XXH3 over every parameter's and buffer's bytes, in name order.
  std::string params_digest();
  int64_t parameter_count();

  // Header of a checkpoint of the current state (step, digests, data
  // position); no tensors or parts (rank/state_io adds those).
  pb::checkpoint_meta checkpoint_meta(const std::map<std::string, double>& metrics, uint64_t generation) const;

  // The whole training state as named, contiguous CPU tensors, in a fixed
  // order that is the same on every rank of a job: "model/<parameter>",
  // "buffer/<buffer>", "optim/..." (flat_adamw::state_tensors),
  // "optim/steps" (int64[1]), "train/rng" (uint8, the CPU generator).
  // The model and optimizer entries are the live tensors (reading them reads
  // the state; writing them, under NoGradGuard, sets it); the scalar entries
  // are snapshots taken by this call. After writing into them, call
  // state_loaded(step) to apply the scalars and set step().
  // With a sharded optimizer (shard_optimizer), its entries are the windows
  // this rank holds.
  std::vector<state_tensor> state_tensors();
  void state_loaded(int64_t step);
  // ZeRO: keeps the optimizer state of index-space `ranges` only
  // (model/shard_plan); apply_update() then steps only those parameters and
  // the caller gathers the others' (rank/zero). All of it: unsharded.
  // With train.zero >= 2 the gradients are sharded too (flat_adamw::shard_grads).
  void shard_optimizer(const std::vector<std::pair<int64_t, int64_t>>& ranges);
  flat_adamw& optimizer() { return *optimizer_; }

  // After a load that failed half-way (the tensors hold a mix): the initial
  // state again, as create() built it (step 0).
  status reset_state();

  // checkpoint.direct (rank/part_writer): called before anything here
  // changes the parameters, the optimizer's moments or DiLoCo's outer state
  // (the update, an outer step, a reshard, a reset; the swap to the global
  // parameters for an evaluation or a digest), so that a checkpoint write
  // still reading them finishes first. A step's forward and backward do not
  // call it. Empty: nothing to wait for.
  void set_before_update(std::function<void()> f) { before_update_ = std::move(f); }

 private:
  void before_update() {
    if (before_update_) before_update_();
  }
  std::function<void()> before_update_;
  // Clip (by global_norm, or by this rank's own gradient norm), step the
  // optimizer at the learning rate of step lr_step, zero the gradients;
  // step() unchanged. The gradient norm before clipping.
  double update_at(std::optional<double> global_norm, int64_t lr_step);
  // A replayed slice's update (its gradients in place): at step's learning
  // rate, to the fragments flagged (empty: all), step() unchanged.
  double replay_update(int64_t step, const std::vector<bool>& fragments);
  training_state(const config& cfg, std::unique_ptr<task> t);
  config cfg_;
  std::unique_ptr<task> task_;
  std::unique_ptr<flat_adamw> optimizer_;
  std::unique_ptr<data_order> order_;
  std::unique_ptr<outer_optimizer> outer_;  // train.sync = diloco
  int64_t flight_window_ = 0;               // outer_launch: its fragment's inner steps since it last synchronised
  // A world of one (train_step): lands what is due and launches what is due.
  void outer_alone();
  lr_schedule schedule_;
  int64_t step_ = 0;
  torch::Tensor optim_steps_, rng_;  // the scalar entries of state_tensors()
  int64_t micro_batch_ = 0;
  int64_t block_shards_ = 1, read_ahead_shards_ = 0;  // sharded data only
  bool bf16_ = false;
  bool params_mixed_ = false;
  bool record_samples_ = false;
  std::vector<int64_t> recorded_;  // see recorded_samples()
  std::optional<int64_t> interrupted_at_;                 // see has_interrupted_step()
  std::optional<std::pair<int64_t, double>> last_norm_;  // (step reached, norm clipped with)
};

// Sets intra-op and BLAS threads (train.threads; 0 = all cores).
void configure_threads(const config& cfg);

}  // namespace dtactor
