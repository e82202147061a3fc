#pragma once
// A generation's starting state and where it comes from (rank/lifecycle.hpp).
//
// starting_state::agree runs the start in order:
//   1. before the agreement, what changes the step a rank holds: global
//      rank 0 reads the plan's checkpoint when nobody alive may hold
//      anything newer (the checkpoint source), and ZeRO-2's step
//      interrupted here is finished with the norm its peers computed;
//   2. the generation's one agreement round (rank/agreement);
//   3. the state source the agreement chose: the rank's own (everyone
//      holds the agreed step) or a peer's (broadcast from the root, the
//      lowest rank holding it; the state of the plan's checkpoint when the
//      root read it there), or a peer's sent while the first step trains
//      (rank/healing, cluster.heal_while_training); then the
//      sync strategy takes its own from that checkpoint (DiLoCo: a
//      worker's section, take_own_section);
//   4. with train.zero >= 1, the shard source the agreement chose: the
//      checkpoint's parts when the agreed state is the plan's checkpoint,
//      else the surviving holders (replicas), falling back to the plan's
//      fallback checkpoint when both holders of a shard are lost;
//   5. the sync strategy's own, from its agreed words.
// Each source is a class behind one of two interfaces (state_source,
// shard_source), chosen once from the agreement. The plan's checkpoint
// steps are the one authority on which checkpoint a generation uses; no
// rank picks one itself.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rank/agreement.hpp"
#include "rank/outcome.hpp"

namespace dtactor {

struct generation_run;
struct rank_state;
struct shard_plan;
class training_state;

// What the sources share: the generation, the rank's state, and what the
// agreement round said.
struct start_context {
  generation_run& g;
  rank_state& rs;
  training_state& state;
  agreement agreed;               // the state's: highest step, root
  bool agreed_from_disk = false;  // the agreed state is a checkpoint's: the plan's, which rank 0 read, or one read in a generation cut short
  std::vector<int64_t> strategy_agreed;  // the sync strategy's words, reduced
  bool own_window = true;         // DiLoCo: this rank held the agreed anchor (keeps its window)
  int64_t held_before = -1;       // the step this rank held before any transfer
  bool any_params_mixed = false;  // some rank's parameters are a mix of two steps (the agreement's)
};

// Where this rank's part of the agreed state (parameters, buffers, the
// replicated optimizer state, the step) comes from.
class state_source {
 public:
  virtual ~state_source() = default;
  virtual generation_end take(start_context& c) = 0;
};

// Where this rank's ZeRO shards of the optimizer moments come from, under
// the generation's shard plan.
class shard_source {
 public:
  virtual ~shard_source() = default;
  virtual generation_end take(start_context& c, const shard_plan& plan) = 0;
};

// The state source the agreement names: none to take (everyone holds the
// agreed step), the root's send while training (rank/healing: heals), or
// the root's broadcast.
std::unique_ptr<state_source> choose_state_source(const start_context& c);
// The shard source the agreement names: the plan's checkpoint, or the
// surviving holders (falling back to the plan's fallback checkpoint),
// before the first step or, healing, while it trains (rank/healing).
std::unique_ptr<shard_source> choose_shard_source(const start_context& c);

// The plan's checkpoints, read through the load planner (rank/state_io,
// storage/checkpoint_plan): the one path of every checkpoint load.
class checkpoint_source final : public shard_source {
 public:
  // Global rank 0, before the agreement: the plan's checkpoint (with
  // train.zero >= 1 its replicated part only), when it is newer than what
  // this rank holds.
  static generation_end replicated_part(start_context& c);
  // DiLoCo, a generation whose state came from the checkpoint: this rank's
  // own inner state from its section, when the checkpoint has one.
  static generation_end worker_section(start_context& c);
  // Both holders of some shard were lost (`missing`): the plan's fallback
  // checkpoint, or a fresh start from step 0 when there is none.
  static generation_end fallback(start_context& c, const shard_plan& plan, const std::string& missing);
  // This rank's own shards from the parts of the checkpoint at the agreed
  // step (the plan's).
  generation_end take(start_context& c, const shard_plan& plan) override;

 private:
  struct load_request;
  static generation_end load(start_context& c, load_request& l);
  static generation_end shards_at(start_context& c, const shard_plan& plan, int64_t step);
};

class starting_state {
 public:
  starting_state(generation_run& g, rank_state& rs);
  // Agrees on the state and takes it; nothing to go on, or the outcome
  // that ends the generation.
  generation_end agree();

 private:
  generation_end complete_interrupted_step();
  generation_end run_agreement();
  int64_t held_step() const;  // the step (DiLoCo: anchor) this rank holds

  start_context c_;
};

}  // namespace dtactor
