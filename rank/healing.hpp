#pragma once
// Healing while training (cluster.heal_while_training), a state source
// (rank/state_source.hpp) beside the broadcast before the first step.
//
// A generation whose ranks do not all hold the agreed step starts training
// at once. Its first step (the heal step) is trained by the ranks holding
// the agreed state as a world of their own: each takes its slice of the
// step's global batch split over the holders only (data_order: the same
// samples, only who computes them changes), while the root sends the state
// to the others (the healing ranks) point to point over the generation's
// transfer group, on a thread of its own. A healing rank computes nothing:
// it adds zeros to the step's gradient sum, waits for the state at the
// update (training_state::set_update_fence), and applies the summed
// gradient to it, as every holder does to its own: all end the step at the
// same state. The root's update waits for its send (the state it sends is
// the one before the step: parameters and moments change only in the
// update; what a forward may change is copied when the step begins).
//
// Where it applies: train.sync = every_step at train.zero = 0 with fp32
// parameters, a state agreed from a live peer (not read from a checkpoint),
// and a step left to train. Elsewhere the state is broadcast before the
// first step (peer_state).
#include <memory>

#include "rank/outcome.hpp"

namespace dtactor {

struct start_context;
class state_source;

// Whether this generation's start heals while training (above).
bool heals(const start_context& c);
// The state source that starts the heal step's transfer.
std::unique_ptr<state_source> make_healing_state();

}  // namespace dtactor
