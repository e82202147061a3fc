#pragma once
// train.zero = 3 across a generation's group: parameters sharded as the
// moments are (model/shard_plan: each shard on its holders, the primary and
// the replicas, which all step it). Between uses a rank keeps resident only
// the parameters of the shards it holds and those of no unit (the root:
// embeddings, final norms, heads); every other page of the parameters'
// flat buffers is given back to the kernel (madvise MADV_DONTNEED: it
// reads as zeros and takes no memory until written). With train.precision
// = bf16 the bf16 copies a unit computes with, its shards' included, exist
// only while it is gathered: a rank rounds its shards' masters into them
// right before the gather, so between uses it keeps the float32 masters of
// its shards and the copies of no unit's parameters.
//
// A unit (dtactor/param_gate.hpp: a block of the built-in models) is
// gathered right before its forward, each piece broadcast over the group
// from its shard's primary, and released after it; gathered again before
// its backward and released after. The next unit's gather (forward) or the
// previous one's (backward) is started while the current one computes, so
// at most two units are gathered at once. The gradients are reduce-scattered
// into the holders' shards as at train.zero = 2, and after the update the
// root is gathered again (in bf16: its copies).
//
// The same gatherer serves train.precision = bf16 at train.zero = 1 and 2
// (unit_policy::copies_resident below), where only the float32 masters are
// sharded and the bf16 copies stay whole.
//
// Every rank makes the same calls in the same order (the model runs its
// units alike everywhere), so the broadcasts are matched across ranks.
// A failed gather is kept (failure()) and later calls do nothing: the
// step's computation goes on with whatever the released pages hold and the
// step fails at its end, as a failed gradient exchange does.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/param_sync.hpp"
#include "dtactor/param_gate.hpp"
#include "dtactor/result.hpp"
#include "base/page_pool.hpp"
#include "model/shard_plan.hpp"
#include "rank/zero.hpp"

namespace dtactor {

class flat_adamw;
class shm_group;

using index_spans = std::vector<std::pair<int64_t, int64_t>>;

// Where each unit's parameters lie in the optimizer's index space.
struct unit_layout {
  std::vector<std::string> names;
  std::vector<index_spans> units;  // ascending, adjacent merged
  index_spans root;                // of no unit
};
// Error: a unit's parameter the optimizer does not step, or one in two units.
result<unit_layout> unit_layout_of(const flat_adamw& opt, const std::vector<param_unit>& units);

// The initial values of every unit built deferred (param_unit::initial)
// written where they lie in `ranges` (ascending, the index space): the
// shards a rank holds at the job's first step. A unit at a time, made
// only when `ranges` reach it: its values exist only while they are copied.
// Error: a unit whose values do not match its parameters.
status make_initial_units(flat_adamw& opt, const std::vector<param_unit>& units, const index_spans& ranges);

// The spans of `spans` outside `held` (both ascending).
index_spans spans_outside(const index_spans& spans, const index_spans& held);

// Which way the units' gathers go. With members, through the shared-memory
// segment of those global ranks (in the segment's order, this rank among
// them): a rank publishes its pieces of the next unit while the current one
// computes and reads the others' when the unit is needed (when the unit's
// pieces fit half the ring; else in rounds, when needed): the world's ranks on one host, or this host's ranks when the
// hosts each hold every shard between them (hosts_cover_every_shard: no
// parameter byte crosses hosts; a host of one rank holds every shard and
// needs no segment). Without: broadcasts over the group.
struct gather_route {
  std::shared_ptr<shm_group> segment;
  std::vector<int> members;
  bool within_hosts = false;
  // The route a generation's exchange plan allows (rank/exchange_choice).
  static gather_route over_group() { return {}; }
  static gather_route through(std::shared_ptr<shm_group> segment, std::vector<int> members, bool within_hosts);
};

// When a unit's parameters are whole on every rank.
//   each_pass     train.zero = 3: gathered for its forward and again for
//                 its backward, released after each (the gate's hooks)
//   copies_resident  train.precision = bf16 at train.zero = 1 or 2: the
//                 bf16 copies the module computes with stay whole (2 bytes
//                 a parameter), gathered once after each update from the
//                 primaries, as DeepSpeed's bf16 optimizer all-gathers its
//                 bf16 parameters; only the float32 masters are sharded
//                 (no root: every parameter's master is in a unit). The
//                 hooks are not installed.
enum class unit_policy { each_pass, copies_resident };

// The layout a policy gathers: each_pass, the task's; copies_resident, the
// task's units and its root as one more unit (one unit for a task without).
unit_layout layout_for(unit_layout task_layout, unit_policy policy);

class unit_gatherer final : public param_gate {
 public:
  unit_gatherer(c10::intrusive_ptr<c10d::ProcessGroup> pg, flat_adamw& opt, const shard_plan& plan, unit_layout layout,
                std::chrono::milliseconds timeout, std::function<bool()> abandon, gather_route route = {},
                std::chrono::microseconds spin = std::chrono::microseconds(0), unit_policy policy = unit_policy::each_pass);
  ~unit_gatherer() override;

  void before_forward(int unit) override;
  // The last unit stays gathered when a backward follows (grad mode on): it
  // is the first the backward needs.
  void after_forward(int unit) override;
  void before_backward(int unit) override;
  void after_backward(int unit) override;

  // Every unit released and the root gathered (after the update, and once
  // at the generation's start, when every parameter was made whole; with
  // root_sharded(), at every generation's start: its masters move with the
  // shards, and its copies come from them);
  // copies_resident: every unit's copies gathered (after the update, and
  // at each generation's start).
  status after_update();
  // For what reads every parameter in an order alike on every rank (the
  // digest): before `t` is read, its unit is gathered (and the unit needed
  // before released); done_reading() releases the last. A unit at a time;
  // with root_sharded(), the root's masters are gathered as one more.
  void before_reading(const torch::Tensor& t);
  status done_reading();
  // Every unit's pages outside this rank's shards given back.
  void reshard();
  // One forward and backward's gathers without computing (a rank with fewer
  // micro-batches than another: the collectives must match).
  void idle_pass();
  // The first failed gather since construction.
  status failure() const;

  int units() const { return static_cast<int>(state_.size()); }
  bool through_shared_memory() const { return !route_.members.empty(); }
  bool within_hosts() const { return route_.within_hosts; }
  unit_policy policy() const { return policy_; }
  // train.precision = bf16 at train.zero = 3 (each_pass): the masters of no
  // unit are sharded; every rank keeps their bf16 copies, gathered from
  // the primaries after each update and at each generation's start.
  bool root_sharded() const { return rounds_held() && !layout_.root.empty(); }
  // Bytes of parameters resident between steps: the held shards and the root.
  int64_t resident_bytes() const;
  const unit_layout& layout() const { return layout_; }
  // each_pass: the pool keeping released units' pages for the next gathers
  // (null where a buffer a gather writes is no private anonymous mapping).
  const page_pool* pool() const { return pool_.get(); }
  // Seconds in the forward and backward gates (gathers and releases, the
  // waits included) since the last call.
  double take_pass_seconds() { return std::exchange(pass_s_, 0.0); }

 private:
  enum class residency { released, in_flight, resident };
  struct unit_state {
    residency is = residency::released;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;     // over the group
    std::vector<host_param_gather> ahead;                  // through shared memory: published, to be read
  };
  // `masters`: the fp32 masters move, not (train.precision = bf16) the
  // bf16 copies a unit computes with.
  status start(const index_spans& spans, std::vector<c10::intrusive_ptr<c10d::Work>>& works, bool masters = false);
  result<std::vector<host_param_gather>> segment_gathers(const index_spans& spans, bool masters);
  status through_segment(const index_spans& spans, bool masters = false);
  status gather_now(const index_spans& spans, bool masters = false);
  status wait(std::vector<c10::intrusive_ptr<c10d::Work>>& works);
  void begin_gather(int unit);
  void publish_ahead(int unit);
  void settle(int unit);
  void finish_gather(int unit);
  void release(int unit);
  // each_pass: what a gather of `unit` writes (the masters outside this
  // rank's shards; in bf16 the copies, its own shards' too).
  std::vector<torch::Tensor> written_views(int unit) const;
  // Their pages into the pool (once a gather wrote them), or to the kernel;
  // and back from the pool before a gather writes them.
  void hand_back(int unit);
  void take_back(int unit);
  void make_pool();
  // Whether `v` lies in a private anonymous mapping (anonymous_): its pages may go to the pool.
  bool poolable(const torch::Tensor& v) const;
  struct byte_runs {
    std::vector<std::pair<char*, size_t>> pooled, other;
  };
  byte_runs written_runs(int unit) const;
  // root_sharded(): the root's masters outside this rank's shards given back.
  void release_root_masters();
  int unit_at(int64_t index) const;
  void round_gathered(const index_spans& spans);
  // train.precision = bf16, each_pass: this rank's shards of `unit` rounded
  // into the copy it computes with (and the others receive) right before
  // the unit is gathered; the copy is given back with the unit.
  void round_held(int unit);
  bool rounds_held() const { return policy_ == unit_policy::each_pass && mixed_; }
  status gather_copies();
  void fail(const std::string& why);

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  flat_adamw& opt_;
  const shard_plan& plan_;
  unit_layout layout_;
  std::vector<index_spans> released_;  // per unit: its spans outside this rank's shards
  std::vector<index_spans> held_;      // per unit: its spans in this rank's shards
  index_spans root_released_, root_held_;  // the root's, likewise
  std::chrono::milliseconds timeout_;
  std::function<bool()> abandon_;
  std::vector<unit_state> state_;
  std::string failure_;
  int reading_ = -1;  // before_reading's unit (units(): the root's masters)
  int ahead_ = -1;    // the unit published ahead through the segment and not yet read
  gather_route route_;
  std::chrono::microseconds spin_;
  unit_policy policy_;
  bool mixed_ = false;  // the optimizer's train.precision = bf16
  // each_pass: the pages of released units kept for the next gathers (the
  // two largest units' worth: base/page_pool), those in private anonymous
  // mappings; any other page, or every one without a pool, is given back
  // to the kernel (MADV_DONTNEED).
  double pass_s_ = 0;
  std::unique_ptr<page_pool> pool_;
  private_anonymous_ranges anonymous_;  // as when the gate was made
  std::vector<char> pages_out_;  // per unit: its written pages are out (pooled or given back) since its last gather
};

// The generation's parameter sync where the masters are sharded: the norm
// as `inner`'s (the gradient shards' at train.zero >= 2, over the same
// path), and after the update the gate's gathers (train.zero = 3: the
// root's, the units' during the passes; copies_resident: every copy).
std::unique_ptr<param_sync> zero3_sync(std::unique_ptr<param_sync> inner, std::shared_ptr<unit_gatherer> gate, std::string backend);

}  // namespace dtactor
