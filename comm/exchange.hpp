#pragma once
// How a gradient bucket's bytes travel between ranks: one class per
// transport behind one interface (the shape of PyTorch DDP's comm hooks).
// The reducer (grad_sync) owns the buckets, the autograd hooks, the overlap
// with backward, the step control and the timing; it does not know which
// transport runs. An exchange only moves bytes and leaves the world's SUM
// in each bucket's flat tensor.
//
// Transports (make_exchange picks one per generation from its
// exchange_spec, exchange_spec.hpp, every rank alike):
//   process group  the world's group (Gloo or NCCL): fp32 ring allreduce,
//                  or the spec's codec (exchange_registry.hpp: bf16, int8,
//                  int4) around an all-gather of every rank's encoded
//                  bucket or, for bf16 from 3 ranks on, a reduce-scatter
//                  and an all-gather of the encoded shards
//   zero scatter   train.zero = 2 on a process group: a reduce-scatter built
//                  from an all-to-all; each rank receives only the pieces it
//                  keeps (its shards, replicas included) and sums them (the
//                  codec's encoding on the wire)
//   shared memory  every rank on one host: buckets published in shared
//                  memory, summed by every rank (sum_slots' order)
//   hierarchical   several hosts with several ranks: shared memory within a
//                  host, the host's leader runs the process-group exchange
//                  above (with the codec) on the group of leaders, and
//                  hands the result back through shared memory
//   host           a host's ranks alone through its segment, no group
// With train.zero = 2 (exchange_bucket::kept_by set), shm sums only the
// pieces this rank keeps and hierarchical sums everything (the reducer keeps
// its pieces).
// A new codec is a class and a registration (exchange_registry.hpp); a new
// transport is a class behind bucket_exchange and a case in make_exchange.
//
// Contract, per step, identical on every rank so collectives match:
//   pack into staging(b); start(b) for b = 0, 1, ... in order (from
//   backward's hooks or from finish); flush() once after the last start;
//   wait(b) for b = 0, 1, ... in order; end_step() after every wait
//   succeeded. Control words (the tail of the last bucket, see
//   step_control.hpp) are summed exactly by every transport. Any error
//   fails the step: the reducer calls abort() and never uses the exchange
//   again (its group may still be inside a collective; see communicator.hpp).
// Runs on the training thread only (start() also from backward's hooks,
// which run on it for CPU backward).
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtactor/result.hpp"
#include "comm/communicator.hpp"
#include "comm/exchange_registry.hpp"
#include "comm/exchange_spec.hpp"
#include "comm/shm_group.hpp"

namespace dtactor {

using exchange_clock = std::chrono::steady_clock;

// One bucket as the reducer lays it out and an exchange moves it.
struct exchange_bucket {
  // Gradients, then (last bucket only) the step's control words.
  torch::Tensor flat;
  int64_t grads = 0;  // leading gradient elements; the rest are control words
  std::string label;  // names the bucket's exchange in errors ("rank 2: allreduce of gradient bucket 0")
  // When the bucket went on its way and when it arrived (steady clock ns, 0
  // while in flight; set by the group's thread): the reducer's timing.
  exchange_clock::time_point launched_at;
  std::shared_ptr<std::atomic<int64_t>> done_ns = std::make_shared<std::atomic<int64_t>>(0);

  // train.zero = 2: for each rank of the world, the pieces of this bucket's
  // gradients it keeps, (offset, length) in elements, ascending; empty when
  // every rank keeps all of it. The control words are kept by every rank.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> kept_by;
  // Elements of `flat` (the reducer may drop `flat` between steps).
  int64_t numel = 0;

  int64_t control_words() const { return numel - grads; }
  void mark_launched();
  void mark_done() const;
};

// How an exchange waits: the deadline comes per call.
struct exchange_waits {
  // Polled while waiting: true abandons the step (a newer generation).
  std::function<bool()> abandon;
  // Poll (yielding) this long before sleeping (cluster.spin_wait_us).
  std::chrono::microseconds spin{0};
  // How long start() may wait (for a shared-memory ring's region to be
  // free): the collective timeout.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

class bucket_exchange {
 public:
  virtual ~bucket_exchange() = default;
  // Where the reducer packs bucket b's gradients (and control words) this
  // step: the bucket's flat tensor, or this rank's shared-memory slot.
  virtual torch::Tensor staging(size_t b) { return buckets_[b].flat; }
  // Bucket b is packed; buckets are started in order.
  virtual status start(size_t b) = 0;
  // Every bucket was started (a transport's second phase starts here).
  virtual status flush(exchange_clock::time_point) { return {}; }
  // Bucket b's SUM over the world is in its flat tensor.
  virtual status wait(size_t b, exchange_clock::time_point deadline) = 0;
  // The step succeeded (a shared-memory exchange reserves the next step's regions afresh).
  virtual void end_step() {}
  // The step failed: tell whoever waits on this rank (a host's ranks wait
  // on their leader) instead of leaving them to time out.
  virtual void abort() {}
  // The rest of every bucket's label: "allreduce of gradient bucket ".
  virtual const char* label_stem() const = 0;
  virtual bool uses_shm() const { return false; }
  virtual bool hierarchical() const { return false; }
  virtual bool host_leader() const { return false; }
  // wait(b) may run before flush() and before later buckets were started
  // (the reducer of train.zero = 2 bounds the bytes in flight with it).
  virtual bool waits_early() const { return false; }

 protected:
  explicit bucket_exchange(std::vector<exchange_bucket>& buckets) : buckets_(buckets) {}
  std::vector<exchange_bucket>& buckets_;  // the reducer's, alive as long as this
};

// The groups a transport may use; the reducer fills it from grad_sync_options.
struct exchange_groups {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;  // the world's group
  std::shared_ptr<shm_group> shm;            // the world's (or, hierarchical and host, this host's) segment
  c10::intrusive_ptr<c10d::ProcessGroup> hosts;  // hierarchical, on a host's leader
  bool zero2 = false;  // buckets carry kept_by: the zero scatter on a process group
};

// Builds the spec's transport for these buckets (every rank alike: same
// buckets, same capacity). Shared memory only for float32 buckets that fit
// a slot; otherwise the process group carries them. An error when the
// choice is inconsistent (a host leader without a group of hosts, a
// segment handed to the process-group transport) or the codec is not
// registered.
result<std::unique_ptr<bucket_exchange>> make_exchange(std::vector<exchange_bucket>& buckets, const exchange_spec& spec, const exchange_groups& g,
                                                       const exchange_waits& w);

// The transports, for tests and for make_exchange.
// The world's process-group exchange of codec `c`: fp32 allreduce, or the
// codec's gather or scatter. `what` names it in start errors ("exchange
// across hosts"; empty: "allreduce", "int8 exchange", ...).
result<std::unique_ptr<bucket_exchange>> make_wire_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                            wire_codec c, const exchange_waits& w, std::string what = {});
// train.zero = 2 on `pg`: the pieces of kept_by only (fp32, or the codec's encoding on the wire).
result<std::unique_ptr<bucket_exchange>> make_zero_scatter_exchange(std::vector<exchange_bucket>& buckets,
                                                                    c10::intrusive_ptr<c10d::ProcessGroup> pg, wire_codec c,
                                                                    const exchange_waits& w);
// The shared-memory transport over `shm` alone (a host's ranks, no
// process group); an error when the buckets are not all float32 or do not
// fit its slots.
result<std::unique_ptr<bucket_exchange>> host_exchange(std::vector<exchange_bucket>& buckets, std::shared_ptr<shm_group> shm,
                                                       const exchange_waits& w);
std::unique_ptr<bucket_exchange> make_shm_exchange(std::vector<exchange_bucket>& buckets, std::shared_ptr<shm_group> shm,
                                                   const exchange_waits& w);
// `shm`: this host's segment (null when the rank is alone on its host);
// `across`: on the host's leader, its wire transport over the group of leaders.
std::unique_ptr<bucket_exchange> make_hierarchical_exchange(std::vector<exchange_bucket>& buckets, std::shared_ptr<shm_group> shm,
                                                            std::unique_ptr<bucket_exchange> across, const exchange_waits& w);

// Sums `srcs` (equal sizes) into `dst` in a fixed order, a pairwise tree
// over their order: the first largest power of two below n, then the rest,
// each recursively ((s0+s1)+(s2+s3), ((s0+s1)+s2), ...). The hierarchical
// exchange of 2 hosts with 2^k ranks each adds in this same order, so its
// result is bit-identical to one host's. `scratch` holds a temporary per
// tree level (grown as needed).
void sum_slots(const torch::Tensor& dst, const std::vector<torch::Tensor>& srcs, std::vector<torch::Tensor>& scratch);

// How one generation's gradients travel, worked out by every rank through
// the generation's store (setup_exchange).
struct exchange_plan {
  // The whole world's group (every rank on one host), or this host's
  // (hierarchical); null when the gradients all go through the world's group.
  std::shared_ptr<shm_group> shm;
  // train.zero = 3 (join_gather_segments): a segment of its own for the
  // units' parameter gathers (rank/zero3), of the world's ranks when every
  // rank is on one host, else of this host's ranks (null on a host of one
  // rank, which needs none).
  std::shared_ptr<shm_group> gather;
  // Hierarchical: every host of two ranks or more mapped its gather
  // segment (alike on every rank).
  bool host_gathers = false;
  // Hierarchical, on a host's leader: the group of one rank per host.
  c10::intrusive_ptr<c10d::ProcessGroup> hosts;
  bool hierarchical = false;
  int host_count = 1;  // hosts of the world
  int host_ranks = 1;  // ranks on this rank's host
  std::vector<int> host_members;  // their global ranks, in order (this rank's among them)
  std::vector<std::vector<int>> host_groups;  // every host's global ranks (group_by_host), alike on every rank
  std::string why_not;  // why shared memory is not used, when it is not
  // "gradients over shared memory", "... within the host and gloo across 3 hosts", ...
  std::string describe(const std::string& backend) const;
};

// train.zero = 3, after setup_exchange: the segments the units' gathers
// take turns on, `floats` a slot (the gradients' segment is busy during
// backward). With every rank on one host, one of the world's ranks; when
// hierarchical, one per host of two ranks or more, and `host_gathers` only
// if every such host mapped its own (each host's first rank says so
// through the store, as for the gradients' segments). Nothing otherwise:
// the gathers go over the group. `generation` keeps the names apart.
status join_gather_segments(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int64_t floats, uint64_t generation,
                            exchange_plan& plan);

// The transport this generation's plan allows a spec: one that asks for
// shared memory gets hierarchical, shared_memory, or process_group (no
// segment); any other keeps its own.
exchange_transport transport_for(const exchange_spec& spec, const exchange_plan& plan);

// Ranks grouped by host: equal keys are one host. Hosts are ordered by
// their lowest rank; the ranks of a host in rank order.
std::vector<std::vector<int>> group_by_host(const std::vector<std::string>& keys);

// Called by every rank of a generation after its world group was built,
// with the same `store` (the generation's, or a prefix of it) and this
// rank's `host_key` (base/process.hpp; tests pass their own). `floats`
// is a step's gradients and control words, `largest_floats` the largest
// bucket's, `ring_floats` the bound of a shared-memory slot (0: two steps,
// never bounded); shm_slot_floats sizes the slots from them, with room for
// a whole step and its largest bucket in the hierarchical case. All on one host:
// one shared-memory group for the world. Every rank on a host of its own:
// nothing (the world's group carries the gradients). Otherwise hierarchical:
// a shared-memory group per host with several ranks, and a group of the
// hosts' leaders (`co`: backend, timeout, this rank's address). When a host
// cannot map its segment, every rank falls back to the world's group alike.
// An error only when the store or a group fails.
result<exchange_plan> setup_exchange(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int64_t floats,
                                     const communicator_options& co, const std::string& host_key, int64_t largest_floats = 0,
                                     int64_t ring_floats = 0);

}  // namespace dtactor
