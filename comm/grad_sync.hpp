#pragma once
// Data-parallel gradient synchronisation of one rank: the gradients of a
// module's parameters are packed into flat buckets (in reverse parameter
// order, since backward produces the last layers' gradients first) and each
// bucket is allreduced (SUM) asynchronously as soon as all of its gradients
// are final, while backward goes on computing the earlier layers.
//
// The loss is already divided by the global batch size, so the SUM over the
// ranks of their gradients is the gradient of the global-batch mean loss.
//
// Use per step:
//   for each micro-batch: if it is the step's last, sync.arm(); backward();
//   auto t = sync.finish();   // param.grad() now holds the reduced gradient
//
// Every rank must own the same parameter list (same shapes, same order) and
// call arm()/finish() once per step; buckets are launched in bucket order on
// every rank, so collectives always match even when a rank's gradients arrive
// in a different order or not at all.
//
// How a bucket's bytes travel is not this class's business: it hands each
// packed bucket to a bucket_exchange (exchange.hpp) that make_exchange
// builds from the options' exchange_spec (a transport and a codec from the
// registry, exchange_registry.hpp).
//
// Not thread-safe across steps: arm(), backward and finish() run on the
// training thread (LibTorch runs a CPU backward on the calling thread).
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtactor/result.hpp"
#include "comm/bucket_buffers.hpp"
#include "comm/exchange.hpp"
#include "comm/param_sync.hpp"
#include "comm/step_control.hpp"

namespace dtactor {

// train.zero = 2: gradients are reduce-scattered, so each rank receives the
// world's sum only of the elements it holds optimizer state for, and
// autograd's full gradients are dropped as soon as a bucket took them.
struct zero2_grads {
  // Each parameter that requires grad (in the constructor's order): its
  // first element in the optimizer's index space (flat_adamw::param_index).
  std::vector<int64_t> param_index;
  // Per rank of the world: the index-space ranges it holds (shard_plan::ranges_of).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> held;
  // Receives this rank's summed gradients of index-space [index, index + n)
  // (n = sum.numel()), within one of its held ranges and one parameter.
  std::function<void(int64_t index, const torch::Tensor& sum)> deliver;
  // Buckets whose exchange is still running during backward hold at most
  // about this many bytes: beyond it, the oldest is waited for, delivered
  // and its buffer dropped (transports that allow it: shared memory, the
  // zero scatter). 0 = no bound.
  int64_t inflight_bytes = 64 << 20;
};

struct grad_sync_options {
  // A bucket is closed once it holds at least this many bytes (cluster.bucket_kb * 1024);
  // a single parameter larger than this gets a bucket of its own.
  int64_t bucket_bytes = 256 * 1024;
  // Upper bound for finish() to wait for all buckets (cluster.collective_timeout_ms).
  std::chrono::milliseconds timeout{30000};
  // When true, finish() also allreduces a small "was used" mask so that a
  // parameter no rank used keeps an undefined grad, as in a single process
  // (AdamW then skips it). When false such a parameter gets a zero grad.
  // Costs one extra small collective per step.
  bool find_unused_parameters = false;
  // finish() first waits for each bucket by polling it (yielding the core
  // between polls) for up to this long, then sleeps until it completes.
  // Sleeping lets an idle virtual CPU halt, and a halted vCPU can take a
  // scheduler slice of the host (~3-4 ms) to wake for the collective's next
  // message; polling keeps it awake. 0 = sleep at once.
  std::chrono::microseconds spin_wait{0};
  // Polled while finish() waits: true abandons the step's collectives (a
  // newer generation replaces this one). May be empty.
  std::function<bool()> abandon;
  // Carry a step_control at the end of the last bucket, SUM-reduced with
  // it: the step's control at no extra collective (set_control() before the
  // step, control() after finish()). The last bucket is launched when
  // backward ends, so what arrives up to then is in the step's sums.
  bool carry_control = false;
  // Which exchange moves the buckets (exchange_spec.hpp): the transport and
  // the codec of float32 buckets on a process group's wire (cluster.wire_dtype:
  // fp32 exact; bf16 half the bytes, all-gather at 2 ranks, reduce-scatter
  // + all-gather from 3; int8 / int4 with a scale per block, DiLoCo's
  // pseudo-gradients). Control words travel exactly (fp32).
  //   process_group  every bucket through pg (`shm` must be null)
  //   shared_memory  every rank of the group on this host (see shm_group):
  //                  each bucket is published into this rank's slot of `shm`
  //                  as soon as backward filled it, and finish() sums the
  //                  ranks' slots; only float32 buckets that fit its
  //                  capacity, else pg carries them all
  //   hierarchical   a world over several hosts with several ranks on some:
  //                  `shm` is this host's group (null when this rank is alone
  //                  on its host) and `hosts` the group of one rank per host,
  //                  set on that rank (the host's leader) only; falls back to
  //                  pg on every rank alike when the buckets do not fit
  //   host           this host's ranks only, through `shm`: the reducer's
  //                  world is the segment's, and pg is not used
  //                  (train.diloco_worker = host: a DiLoCo worker made of a
  //                  host's ranks, synchronous inside); with no segment
  //                  (alone on its host) every call is a no-op
  exchange_spec exchange;
  std::shared_ptr<shm_group> shm;
  c10::intrusive_ptr<c10d::ProcessGroup> hosts;
  // train.zero = 2 (see zero2_grads); null: every rank gets every gradient.
  std::shared_ptr<const zero2_grads> zero2;
  // Bucket buffers kept across reducers (bucket_buffers.hpp): this one
  // takes its buffers from there when they fit and gives them back when
  // destroyed. Null: its own, zeroed. Not with zero2 (its buffers live
  // only while a bucket is in flight).
  std::shared_ptr<bucket_buffers> recycled;
};

// The bucket buffers a reducer over `params` (the module's, in order) with
// options `o` allocates, zeroed, in bucket order: what a warm rank puts
// into o.recycled before its first plan.
std::vector<torch::Tensor> bucket_buffers_for(const std::vector<torch::Tensor>& params, const grad_sync_options& o);

// Figures of one step's synchronisation (seconds).
struct grad_sync_timing {
  // Wall time during which at least one bucket allreduce was in flight.
  double allreduce_s = 0;
  // Time finish() spent waiting: the part of allreduce_s NOT hidden behind backward.
  double exposed_s = 0;
  int buckets = 0;
  // Buckets whose allreduce started before finish() was called (during backward).
  int launched_in_backward = 0;
  // 1 - exposed/allreduce (1 when nothing was exposed, 0 when nothing overlapped).
  double overlap_fraction() const { return allreduce_s > 0 ? std::max(0.0, 1.0 - exposed_s / allreduce_s) : 1.0; }
};

class grad_sync {
 public:
  // params: the module's parameters in module order (only those requiring grad
  // are synchronised). pg may be null when world size is 1; with a group of
  // size 1 or no group every call is a no-op.
  grad_sync(std::vector<torch::Tensor> params, c10::intrusive_ptr<c10d::ProcessGroup> pg, grad_sync_options opts = {});
  ~grad_sync();
  grad_sync(const grad_sync&) = delete;
  grad_sync& operator=(const grad_sync&) = delete;

  // The next backward is the last of this step: launch each bucket's
  // allreduce as soon as its gradients are final. Backwards that run while
  // not armed (earlier micro-batches) only accumulate, as usual.
  void arm();

  // Launches whatever bucket backward did not (unused parameters, or no
  // backward at all on this rank), waits for every bucket (at most
  // options.timeout in total), writes the reduced gradients into each
  // param.grad() and disarms. Never throws. After an error the collectives of
  // this step may still be running inside the process group; this object
  // then refuses every later step: rebuild it with a new group.
  result<grad_sync_timing> finish();
  // Packs and starts every bucket not started yet, without waiting: the
  // exchange runs while the caller does other work (DiLoCo's overlapped
  // outer exchange), and a later finish() waits for it. Between the two the
  // parameters' gradients may be reused: finish() overwrites them with the
  // sums. A transport's second phase (flush) still starts in finish().
  void launch_all();

  // What this rank adds to the step's control (options.carry_control); read
  // when the last bucket is launched.
  void set_control(const step_control& c) { control_in_ = c; }
  // Or where to read it from when the last bucket is launched, at the end of
  // backward (a world of one: at finish()), replacing what set_control()
  // gave: a plan or a stop that arrives during the step's forward or
  // backward pass is then agreed after this step instead of the next.
  // Called on the thread that runs backward. Empty: set_control() alone.
  void set_control_source(std::function<step_control()> source) { control_source_ = std::move(source); }
  // After a successful finish(): the SUM over all ranks of their controls
  // (this rank's own with a world of one).
  const step_control& control() const { return control_out_; }

  // A sharded optimizer's parameter sync for this reducer's steps (ZeRO:
  // comm/param_sync.hpp), or null (none: every rank holds every parameter).
  void set_parameter_sync(std::unique_ptr<param_sync> p) { param_sync_ = std::move(p); }
  param_sync* parameter_sync() const { return param_sync_.get(); }
  std::unique_ptr<param_sync> take_parameter_sync() { return std::move(param_sync_); }

  int world() const { return world_; }
  // True when the buckets go through shared memory (options.shm was usable),
  // for the whole world or, hierarchical, within this host.
  bool uses_shm() const { return exchange_ && exchange_->uses_shm(); }
  // True when the exchange is hierarchical (the transport asked for it and the buckets fit).
  bool hierarchical() const { return exchange_ && exchange_->hierarchical(); }
  // Hierarchical: this rank exchanges its host's sum with the other hosts.
  bool host_leader() const { return exchange_ && exchange_->host_leader(); }
  int rank() const { return rank_; }
  size_t bucket_count() const { return buckets_.size(); }
  // Parameter indices (into the constructor's list) of each bucket, in launch order.
  std::vector<std::vector<size_t>> bucket_layout() const;
  // Bytes of bucket buffers held between steps (zero2: none).
  int64_t buffer_bytes() const;
  // Of them, those taken from options.recycled when it was built.
  int64_t reused_bytes() const { return reused_bytes_; }
  // Buckets launched so far in the current armed step (0 after finish()).
  int launched() const { return static_cast<int>(next_launch_); }

 private:
  struct param_slot {
    torch::Tensor param;
    size_t bucket = 0;
    int64_t offset = 0;  // in elements, inside the bucket's flat tensor
    int64_t numel = 0;
    bool ready = false;  // gradient copied into the bucket in this armed step
    bool used = false;   // ... and it was defined (zero2 drops it right away)
  };
  // train.zero = 2: a piece of a bucket this rank keeps.
  struct kept_piece {
    int64_t offset = 0, length = 0;  // in the bucket
    int64_t index = 0;               // in the optimizer's index space
  };
  // What the reducer keeps per bucket beside what the exchange moves.
  struct bucket_fill {
    std::vector<size_t> slots;
    int pending = 0;  // slots not yet ready in this armed step
    std::vector<kept_piece> mine;  // train.zero = 2
    torch::TensorOptions options;  // of the flat tensor (dropped between steps with zero2)
  };
  struct hook_state;

  void on_grad_ready(size_t slot);
  void launch_ready();
  void launch(size_t b);
  void pack(size_t slot);
  void fail_step(std::string why);
  void ensure_flat(size_t b);
  // Bucket b's exchange completed: the control words (bucket 0) read, and
  // with zero2 this rank's pieces delivered and the buffer dropped.
  void take(size_t b);
  void plan_zero2();

  // Construction, in order: slots_ into buckets (fills_: reverse parameter
  // order, one dtype each, closed at bucket_bytes); each bucket's flat
  // tensor (the first also carries the control words); the exchange (false,
  // with broken_ and error_ set, when it cannot be made); the hooks.
  void assign_buckets();
  void allocate_buckets();
  bool open_exchange();
  void install_hooks();

  // finish()'s parts. find_unused_parameters: starts the allreduce of the
  // used-parameter mask into `used` (null, and the step failed, when it
  // could not start; null when not needed).
  c10::intrusive_ptr<c10d::Work> start_used_mask(torch::Tensor& used);
  // Waits (until `deadline`) for the exchange and the mask, and takes every
  // bucket; a failure goes to fail_step.
  void wait_step(const c10::intrusive_ptr<c10d::Work>& used_work, std::chrono::steady_clock::time_point deadline);
  // Seconds some bucket was in flight up to `waited` (the union of their
  // intervals).
  double busy_seconds(std::chrono::steady_clock::time_point waited) const;
  // Copies the reduced buckets into the parameters' grads (a parameter
  // without a grad gets one unless the mask says no rank used it).
  void write_grads(const torch::Tensor& used);
  // Ready for the next armed step.
  void end_step();

  std::vector<param_slot> slots_;
  std::vector<exchange_bucket> buckets_;  // moved by exchange_
  std::vector<bucket_fill> fills_;        // parallel to buckets_
  std::unique_ptr<bucket_exchange> exchange_;
  std::unique_ptr<param_sync> param_sync_;
  step_control control_in_, control_out_;
  std::function<step_control()> control_source_;
  size_t control_bucket_ = 0;   // the last bucket: it carries the control words
  int64_t control_offset_ = 0;  // in that bucket's flat tensor
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  grad_sync_options opts_;
  int world_ = 1, rank_ = 0;
  bool armed_ = false;
  bool failed_ = false;  // this step's collectives failed (error_ says how)
  bool broken_ = false;  // a step failed: every later finish() refuses
  bool misuse_ = false;  // a gradient arrived after its bucket was launched
  std::string error_;
  size_t next_launch_ = 0;
  size_t next_wait_ = 0;        // buckets waited for (and taken) in this armed step
  int64_t inflight_bytes_ = 0;  // zero2: buffers of launched buckets not yet taken
  int64_t reused_bytes_ = 0;    // bucket buffers taken from options.recycled
  std::shared_ptr<hook_state> hooks_;  // disarmed in the destructor; hooks hold it weakly
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep hooked nodes alive
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hook_keys_;
};

}  // namespace dtactor
