#pragma once
// The training engine of one process: AdamW with warm-up + cosine schedule,
// gradient clipping and accumulation, optional bf16 autocast and activation
// checkpointing, evaluation, state as checkpoint sections (exact resume). No
// I/O beyond reading data: the `train` command and the cluster rank
// (rank/) drive it.
//
// Every step is taken through one entry, train_step(step_context), with a
// reducer (comm/grad_sync) between its two halves: forward_backward()
// accumulates this process's share of the gradient; apply_update() clips and
// steps the optimizer. The halves stay public for tests that inspect a
// gradient before the update; no caller trains through them instead.
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

// How training_state::train_step takes a step (see there): as data.

// What the loss sum of this rank's samples is divided by.
enum class loss_mean {
  global_batch,  // every step: the SUM over the ranks is the global-batch mean's gradient
  own_slice,     // DiLoCo's inner step (and a replay): the mean over this worker's own slice
  ranks,         // DiLoCo with hosts as workers: the mean over the slices of step_context::mean_ranks
};
// train.sync = diloco, a lost worker's slice trained again: `step`'s
// slice (its samples, its dropout seed, the learning rate of that step),
// applied to this worker's parameters without moving step(). Streaming:
// `fragments` (one flag per fragment; empty = all) says which fragments
// it is owed to (those whose last pseudo-gradient was taken before
// `step`); the others' parameters and moments are left as they were.
// With a reducer (the ranks of a host together), this rank computes its
// `part` of the slice's samples split in `parts`, and every rank of the
// host applies the same update.
struct replayed_slice {
  int64_t step = 0;
  std::vector<bool> fragments;
  int part = 0, parts = 1;
};

struct step_context {
  int rank = 0, world = 1;  // whose data_order::rank_slice
  // Sums the gradients over its ranks while backward runs (the caller
  // still owns it): the generation's reducer (a world-1 job's has no group
  // and does nothing; train.zero: its parameter_sync gathers after the
  // update and, at 2, gives the norm), or a host's. Null: no collective
  // at all (DiLoCo's inner step of a worker of its own).
  grad_sync* sync = nullptr;
  loss_mean mean = loss_mean::global_batch;
  std::vector<int> mean_ranks;  // loss_mean::ranks (global ranks)
  std::optional<replayed_slice> replay;

  // train.sync = every_step: the reducer sums the global-batch mean's gradient.
  static step_context every_step(int rank, int world, grad_sync& sync) { return {rank, world, &sync, loss_mean::global_batch, {}, {}}; }
  // train.sync = diloco, a worker of its own: its slice, its own mean,
  // clipped by its own norm, its own AdamW; no collective.
  static step_context diloco_inner(int rank, int world) { return {rank, world, nullptr, loss_mean::own_slice, {}, {}}; }
  // train.diloco_worker = host: the host's ranks `host_ranks` (this one
  // among them) each take their slice, `host` sums the gradients, the
  // loss is the mean of the host's samples; no collective beyond the host.
  static step_context diloco_host(int rank, int world, grad_sync& host, std::vector<int> host_ranks) {
    return {rank, world, &host, loss_mean::ranks, std::move(host_ranks), {}};
  }
  // A replayed slice (rank, world: the slice's); `host` with parts > 1.
  static step_context replay_of(int rank, int world, replayed_slice r, grad_sync* host = nullptr) {
    return {rank, world, host, loss_mean::own_slice, {}, std::move(r)};
  }
  // The step a job trains at `rank` of `world` with its reducer `sync`
  // (`diloco`, training_state::diloco(): an inner step; the reducer then
  // carries the outer exchanges).
  static step_context of_job(bool diloco, int rank, int world, grad_sync& sync) {
    return diloco ? diloco_inner(rank, world) : every_step(rank, world, sync);
  }
};

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
  // The unsharded optimizer's gradients and moments made resident before
  // they are needed (flat_adamw::make_resident): a warm rank does it while
  // it waits for a plan. Bytes it may touch first: resident_bytes().
  void make_resident() { optimizer_->make_resident(); }
  int64_t resident_bytes() const { return optimizer_->resident_bytes(); }

  // data.sample_log: while on, forward_backward() keeps the sample indices it
  // passes to the task's loss_sum (every micro-batch, in order) until the
  // next forward_backward(): recorded_samples(). Off (the default): nothing
  // is copied.
  void record_samples(bool on) {
    record_samples_ = on;
    recorded_.clear();
  }
  const std::vector<int64_t>& recorded_samples() const { return recorded_; }

  // The one step entry: the rank's step loop (every sync mode, any world,
  // `dtactor train` at world 1), tune-batch, the benches and the tests all
  // train through train_step(step_context). What differs between them is
  // data in the context (whose slice, which reducer, what the loss is the
  // mean of, a replayed slice), never another entry. DiLoCo's outer step
  // is not a step of this class: outer() runs it after the inner steps
  // (outer_optimizer::after_inner_step).
  //
  // This rank computes its data_order::rank_slice of the step's global
  // batch (of c.replay->step for a replay, else of step()), the reducer
  // c.sync sums the gradients across its ranks while backward runs, then
  // the optimizer steps. On error (a failed or timed-out collective) the
  // optimizer has not stepped and step() is unchanged.
  //
  // A sharded optimizer (ZeRO) syncs through the reducer's parameter sync
  // (grad_sync::parameter_sync, comm/param_sync.hpp): its global norm
  // (train.zero = 2) clips, and its gather runs after the optimizer stepped
  // the shards this rank holds, to bring the others' parameters; when the
  // gather fails, step() has advanced (this rank's shards are the next
  // step's) and params_mixed() says the other parameters may be a mix of
  // two steps; when the norm fails, nothing was updated.
  struct dp_step {
    double loss_sum = 0;                    // this rank's samples only
    int64_t samples = 0;                    // this rank's share of the global batch
    double grad_norm = 0;                   // of the global gradient, before clipping
    double compute_s = 0;                   // forward + backward (including overlapped allreduce)
    double update_s = 0;                    // clip + optimizer (+ gather)
    double gather_s = 0;                    // of update_s: the parameter all-gather (train.zero >= 1)
    double pass_gather_s = 0;               // of compute_s: train.zero = 3's unit gathers and releases
    double allreduce_s = 0, exposed_s = 0;  // see grad_sync_timing
    int buckets = 0, launched_in_backward = 0;
  };
  result<dp_step> train_step(const step_context& c);

  // train.sync = diloco (model/diloco.hpp): the outer optimizer, which runs
  // the outer step at the boundaries.
  bool diloco() const { return outer_ != nullptr; }
  outer_optimizer& outer() { return *outer_; }
  const outer_optimizer& outer() const { return *outer_; }
  // DiLoCo: move to `step` without training (a worker behind its peers
  // after a new generation skips the steps they already took).
  void skip_to(int64_t step);

  // A `gather` failed since the last clear: parameters outside this rank's
  // shards may be a mix of two steps (rank/zero repairs them).
  bool params_mixed() const { return params_mixed_; }
  void clear_params_mixed() { params_mixed_ = false; }
  // Built with units whose values were deferred (model/layers:
  // defer_block_values) and neither made nor received since: the first
  // generation's start makes those of this rank's shards (rank/zero3:
  // make_initial_units) or takes them from their holders.
  bool units_deferred() const { return units_deferred_; }
  void units_settled() { units_deferred_ = false; }

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
  const job_settings& settings() const { return settings_; }  // cfg(), read once
  task& the_task() { return *task_; }
  const data_order& order() const { return *order_; }
  std::vector<torch::Tensor> gradients();

  // What parameter `param` of the module is in the state: itself, or with
  // train.precision = bf16 its float32 master (the optimizer's).
  torch::Tensor state_of(const torch::Tensor& param) const;
  // XXH3 over every parameter's and buffer's bytes, in name order (the
  // masters' with train.precision = bf16).
  // `before_reading` (train.zero = 3: gathers what a rank does not hold)
  // is called with each tensor right before it is read.
  std::string params_digest(const std::function<void(const torch::Tensor&)>& before_reading = {});
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
  // Sharded, on a rank whose moments are not the agreed step's (it joined,
  // restarted or fell behind) before the replicated state comes: it holds
  // no window from now until the reshard gives it its new ones, so that
  // the transfer's layout (state_tensors) does not make worthless moments
  // resident (a fresh rank's window is the whole model) and the reshard
  // does not copy them.
  void drop_stale_moments();
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
  void set_before_update(std::function<void()> f);
  // Runs once, right before the next train_step's update (after the
  // reducer summed the gradients), then is dropped: a rank healing waits
  // there for the rest of the state it receives (its moments), the rank
  // sending it for the send to end. An error there fails that step,
  // nothing updated. Null: none.
  void set_update_fence(std::function<status()> f);

 private:
  void before_update() {
    if (before_update_) before_update_();
  }
  std::function<void()> before_update_;
  std::function<status()> update_fence_;
  // Clip (by global_norm, or by this rank's own gradient norm), step the
  // optimizer at the learning rate of step lr_step, zero the gradients;
  // step() unchanged. The gradient norm before clipping.
  double update_at(std::optional<double> global_norm, int64_t lr_step);
  // A replayed slice's update (its gradients in place): at step's learning
  // rate, to the fragments flagged (empty: all), step() unchanged.
  double replay_update(int64_t step, const std::vector<bool>& fragments);
  training_state(const config& cfg, job_settings s, std::unique_ptr<task> t);
  config cfg_;             // as create() was given it (a checkpoint's meta carries it)
  job_settings settings_;  // cfg_, read once by create()
  std::unique_ptr<task> task_;
  std::unique_ptr<flat_adamw> optimizer_;
  std::unique_ptr<data_order> order_;
  std::unique_ptr<outer_optimizer> outer_;  // train.sync = diloco
  // step()'s halves: the samples, and the update after the reducer.
  std::vector<int64_t> samples_of(const step_context& c, double& divisor);
  // Forward and backward passes of a slice of `samples`; the most of any
  // rank at this step (train.zero = 3: ranks with fewer make up the
  // gathers of the difference, param_sync::idle_pass).
  int64_t micro_batches(size_t samples) const;
  int64_t most_micro_batches(const step_context& c) const;
  result<dp_step> update_after_sync(const step_context& c, dp_step r);
  lr_schedule schedule_;
  int64_t step_ = 0;
  torch::Tensor optim_steps_, rng_;  // the scalar entries of state_tensors()
  int64_t block_shards_ = 1, read_ahead_shards_ = 0;  // sharded data only
  bool params_mixed_ = false;
  bool units_deferred_ = false;
  bool record_samples_ = false;
  std::vector<int64_t> recorded_;  // see recorded_samples()
  std::optional<int64_t> interrupted_at_;                 // see has_interrupted_step()
  std::optional<std::pair<int64_t, double>> last_norm_;  // (step reached, norm clipped with)
};

// Sets intra-op and BLAS threads (train.threads, train_settings::threads;
// 0 = all cores).
void configure_threads(int64_t threads);

}  // namespace dtactor
