#pragma once
// The training thread as the rank actor (actors/rank_actor.hpp) drives it:
// three calls in, four callbacks out. The actor owns this interface and
// rank/rank_worker implements it, so the training side sees neither CAF nor
// the actor, and the torch-free actors know nothing of the training side
// (app/rank.cpp wires the two; tests drive the actor with a fake).
#include <cstdint>
#include <functional>

#include "wire.pb.h"

namespace dtactor {

// Every report is stamped with the generation it belongs to (the worker may
// hold a newer plan while it still trains in the old generation). Called on
// the training thread; must not block for long.
struct rank_work_callbacks {
  std::function<void(uint64_t generation, pb::step_report)> on_step;
  std::function<void(uint64_t generation, pb::eval_report)> on_eval;           // global rank 0 only
  // Every rank: its part of a checkpoint is stored (or why not). Called on
  // the part writer's thread.
  std::function<void(uint64_t generation, pb::checkpoint_written)> on_checkpoint;
  // STATE_IDLE (warmed up, or not in the newest generation), STATE_READY
  // (group built, state agreed), STATE_FINISHED (detail = params digest),
  // STATE_FAILED (a collective or step failed; the worker waits for a newer plan).
  std::function<void(uint64_t generation, pb::rank_status)> on_status;
};

// The training thread as the rank actor sees it. Never blocks.
class rank_work {
 public:
  virtual ~rank_work() = default;
  // Hands over a plan; only plans newer than every plan offered before are
  // kept (false otherwise). The first may be a warm-up plan (generation 0).
  virtual bool offer(const pb::generation_plan& plan) = 0;
  // Stops at a step boundary all ranks agree on; with `checkpoint`, every
  // rank first stores its part of a final checkpoint (checkpoint_written).
  // Then STATE_FINISHED.
  virtual void request_stop(bool checkpoint) = 0;
  // Leaves at once: abandons any collective, the thread ends.
  virtual void quit() = 0;
  // A warm spare (started without a local rank) becomes local rank
  // `local_rank` of its node; called before any plan that names it is
  // offered. A spare already warmed up says STATE_IDLE again as that rank;
  // its first READY in the slot says it was a spare (from_spare).
  virtual void take_slot(int32_t local_rank) = 0;
};

}  // namespace dtactor
