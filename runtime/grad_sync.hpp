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
#include "runtime/communicator.hpp"
#include "runtime/shm_group.hpp"

namespace dtactor {

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
  // Extra float slots carried at the end of the first bucket and SUM-reduced
  // with it: a per-step control word for the caller at no extra collective
  // (set_control() before the step, control() after finish()).
  int control_words = 0;
  // When set (every rank of the group on this host, see shm_group), buckets
  // are exchanged through shared memory instead of Gloo: each bucket is
  // published into this rank's slot as soon as backward filled it, and
  // finish() sums the ranks' slots. Used only for float32 parameters that
  // fit the group's capacity; otherwise the process group carries them.
  std::shared_ptr<shm_group> shm;
  // cluster.wire_dtype = "bf16": buckets that go through the process group
  // (not shared memory) cross the wire as bfloat16, half the bytes of fp32.
  // Gloo (LibTorch 1.13) cannot reduce bf16, so each rank's bf16 bucket is
  // all-gathered and every rank sums the world's buckets itself, in fp32 and
  // in rank order (bit-identical on every rank; one rounding per rank's
  // gradient, none in the sum): at 2 ranks that is half a ring allreduce's
  // bytes. From 3 ranks on (where all-gathering whole buckets would cost as
  // much as fp32 or more) a reduce-scatter instead: an all-to-all of bf16
  // shards, each rank sums its shard in fp32 in rank order and rounds it to
  // bf16 once more, then an all-gather of the shards; half a ring
  // allreduce's bytes at any size. The control words travel exactly (fp32).
  bool bf16_wire = false;
  // Hierarchical exchange, for a world spread over several hosts with
  // several ranks on some of them: `shm` is then this host's group (its
  // ranks only, in global rank order; null when this rank is alone on its
  // host) and `hosts` the group of one rank per host, set on that rank (the
  // host's leader, rank 0 of `shm`) only. The ranks of a host publish their
  // buckets into shared memory as backward fills them; the leader sums them
  // (sum_slots' order), allreduces the host's sum with the other leaders
  // (bf16_wire applies here), and writes the result back into its slot for
  // the host's other ranks. Only one copy of the gradients per host crosses
  // the network. Falls back to the world group `pg` on every rank alike when
  // the gradients do not fit shared memory (not float32, or over capacity).
  bool hierarchical = false;
  c10::intrusive_ptr<c10d::ProcessGroup> hosts;
};

// Sums `srcs` (equal sizes) into `dst` in a fixed order, a pairwise tree
// over their order: the first largest power of two below n, then the rest,
// each recursively ((s0+s1)+(s2+s3), ((s0+s1)+s2), ...). The hierarchical
// exchange of 2 hosts with 2^k ranks each adds in this same order, so its
// result is bit-identical to one host's. `scratch` holds a temporary per
// tree level (grown as needed).
void sum_slots(const torch::Tensor& dst, const std::vector<torch::Tensor>& srcs, std::vector<torch::Tensor>& scratch);

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

// How one generation's gradients travel, worked out by every rank through
// the generation's store (setup_exchange).
struct exchange_plan {
  // The whole world's group (every rank on one host), or this host's
  // (hierarchical); null when the gradients all go through the world's group.
  std::shared_ptr<shm_group> shm;
  // Hierarchical, on a host's leader: the group of one rank per host.
  c10::intrusive_ptr<c10d::ProcessGroup> hosts;
  bool hierarchical = false;
  int host_count = 1;  // hosts of the world
  int host_ranks = 1;  // ranks on this rank's host
  std::string why_not;  // why shared memory is not used, when it is not
  // "gradients over shared memory", "... within the host and gloo across 3 hosts", ...
  std::string describe(const std::string& backend) const;
};

// Ranks grouped by host: equal keys are one host. Hosts are ordered by
// their lowest rank; the ranks of a host in rank order.
std::vector<std::vector<int>> group_by_host(const std::vector<std::string>& keys);

// Called by every rank of a generation after its world group was built,
// with the same `store` (the generation's, or a prefix of it) and this
// rank's `host_key` (runtime/process.hpp; tests pass their own). `floats`
// sizes a shared-memory slot (gradients and control words). All on one host:
// one shared-memory group for the world. Every rank on a host of its own:
// nothing (the world's group carries the gradients). Otherwise hierarchical:
// a shared-memory group per host with several ranks, and a group of the
// hosts' leaders (`co`: backend, timeout, this rank's address). When a host
// cannot map its segment, every rank falls back to the world's group alike.
// An error only when the store or a group fails.
result<exchange_plan> setup_exchange(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int64_t floats,
                                     const communicator_options& co, const std::string& host_key);

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

  // The values this rank adds to the step's control word (size
  // options.control_words); read when the first bucket is launched.
  void set_control(std::vector<float> v) { control_in_ = std::move(v); }
  // After a successful finish(): the SUM over all ranks of their control
  // words (this rank's own with a world of one).
  const std::vector<float>& control() const { return control_out_; }

  int world() const { return world_; }
  // True when the buckets go through shared memory (options.shm was usable),
  // for the whole world or, hierarchical, within this host.
  bool uses_shm() const { return static_cast<bool>(shm_); }
  // True when the exchange is hierarchical (options.hierarchical was usable).
  bool hierarchical() const { return hier_; }
  // Hierarchical: this rank exchanges its host's sum with the other hosts.
  bool host_leader() const { return hier_ && leader_; }
  int rank() const { return rank_; }
  size_t bucket_count() const { return buckets_.size(); }
  // Parameter indices (into the constructor's list) of each bucket, in launch order.
  std::vector<std::vector<size_t>> bucket_layout() const;
  // Buckets launched so far in the current armed step (0 after finish()).
  int launched() const { return static_cast<int>(next_launch_); }

 private:
  struct param_slot {
    torch::Tensor param;
    size_t bucket = 0;
    int64_t offset = 0;  // in elements, inside the bucket's flat tensor
    int64_t numel = 0;
    bool ready = false;  // gradient copied into the bucket in this armed step
  };
  struct bucket {
    std::vector<size_t> slots;
    torch::Tensor flat;
    int64_t base = 0;  // offset of the bucket inside a shared-memory slot (floats)
    std::string label;  // names the bucket's exchange in errors (built once, not per step)
    int pending = 0;  // slots not yet ready in this armed step
    c10::intrusive_ptr<c10d::Work> work;
    std::chrono::steady_clock::time_point launched_at;
    std::shared_ptr<std::atomic<int64_t>> done_ns;  // completion time, set by the group's thread
    // bf16 wire: this rank's message (bf16 gradients, padded to 4 bytes,
    // then the fp32 control words; as kHalf, a type Gloo moves) and the world's.
    torch::Tensor wire_in;
    std::vector<torch::Tensor> wire_all;
    int64_t wire_grads = 0, wire_ctrl_at = 0;  // gradient elements; where the control words start (halves)
    // bf16 wire over 3 or more ranks, a reduce-scatter then an all-gather:
    // wire_in holds one chunk per rank (shard of `shard` bf16 gradients,
    // then the control words in fp32), rs_out the chunks of this rank's
    // shard from every rank (all-to-all); this rank sums them in fp32,
    // rounds its shard to bf16 once (rs_mine) and all-gathers the shards
    // (wire_all, `shard` halves each).
    bool rs = false;
    int64_t shard = 0, chunk = 0;  // halves
    torch::Tensor rs_out, rs_mine, rs_sum;
  };
  struct hook_state;

  void on_grad_ready(size_t slot);
  void launch_ready();
  void launch(size_t b);
  void pack(size_t slot);

  // The region of the bucket's flat tensor that pack() writes: this rank's
  // shared-memory slot of the current parity, or the flat tensor itself.
  torch::Tensor staging(size_t b);
  void reduce_shm(size_t b);
  void sum_wire(size_t b);  // bf16 wire: the world's messages, summed into the flat bucket
  void reduce_shard(size_t b);  // bf16 reduce-scatter: this rank's shard summed, rounded, all-gathered
  void send(size_t b);      // the bucket's collective on the wire group (pg_, or hosts_ when hierarchical)
  // Hierarchical leader: sums the host's slots of the buckets the host has
  // published and sends them across hosts, in bucket order; with `block`,
  // waits for the host's ranks (finish), else only takes what is there.
  void advance_host(bool block, std::chrono::steady_clock::time_point deadline);
  void fail_step(std::string why);

  std::shared_ptr<shm_group> shm_;
  std::vector<torch::Tensor> shm_slots_[2];  // [parity][rank of shm_], views of the segment
  std::vector<torch::Tensor> scratch_;       // sum_slots' temporaries
  bool hier_ = false, leader_ = false;
  c10::intrusive_ptr<c10d::ProcessGroup> hosts_;
  size_t host_next_ = 0;  // hierarchical leader: buckets summed and sent across hosts in this step
  int shm_parity_ = 0;
  uint64_t shm_published_ = 0;  // buckets this rank published in all steps
  uint64_t shm_step_base_ = 0;  // ... before the current step

  std::vector<float> control_in_, control_out_;
  int64_t control_offset_ = 0;  // in the first bucket's flat tensor
  std::vector<param_slot> slots_;
  std::vector<bucket> buckets_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  grad_sync_options opts_;
  int world_ = 1, rank_ = 0;
  bool armed_ = false;
  bool failed_ = false;  // this step's collectives failed (error_ says how)
  bool broken_ = false;  // a step failed: every later finish() refuses
  bool misuse_ = false;  // a gradient arrived after its bucket was launched
  std::string error_;
  size_t next_launch_ = 0;
  int launched_in_backward_ = 0;
  std::shared_ptr<hook_state> hooks_;  // disarmed in the destructor; hooks hold it weakly
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep hooked nodes alive
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hook_keys_;
};

}  // namespace dtactor
