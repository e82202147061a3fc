#pragma once
// A generation's starting state and where it comes from (rank/lifecycle.hpp):
// the plan's checkpoint read by global rank 0 when nobody alive holds
// anything newer, then the one agreement on the highest step (DiLoCo:
// anchor) any member holds, taken from a peer (broadcast_state from the
// root); with train.zero >= 1 the optimizer shards from their surviving
// holders (replicas), or from the checkpoint the plan names when some are
// lost. The plan's checkpoint steps are the one authority on which
// checkpoint a generation uses; no rank picks one itself.
#include <cstdint>
#include <string>
#include <vector>

#include "rank/outcome.hpp"

namespace dtactor {

struct generation_run;
struct rank_state;
struct shard_plan;
class training_state;

class starting_state {
 public:
  starting_state(generation_run& g, rank_state& rs);
  // Agrees on the state and takes it; nothing to go on, or the outcome
  // that ends the generation.
  generation_end agree();

 private:
  struct checkpoint_load;
  generation_end from_plan_checkpoint();
  generation_end finish_zero2_step();
  generation_end take_agreed_state(bool& own_window);
  generation_end worker_section_from_checkpoint();
  generation_end shard_state(bool holds_current);
  generation_end shards_from_fallback(const shard_plan& plan, const std::string& missing);
  generation_end shards_from_checkpoint(const shard_plan& plan, int64_t step);
  generation_end load(checkpoint_load& l);
  int64_t held_step() const;  // the step (DiLoCo: anchor) this rank holds

  generation_run& g_;
  rank_state& rs_;
  training_state& state_;
  // What the agreement round (take_agreed_state) said beyond the state:
  // the agreed state is the plan's checkpoint, and the sync strategy's words.
  bool agreed_from_disk_ = false;
  std::vector<int64_t> strategy_agreed_;
};

}  // namespace dtactor
