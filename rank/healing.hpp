#pragma once
// Healing while training (cluster.heal_while_training), a state source
// (rank/state_source.hpp) beside the broadcast before the first step.
//
// A generation whose ranks do not all hold the agreed step starts training
// at once, every rank on its own slice as always. The root sends the state
// point to point to each rank that does not hold it, over the generation's
// transfer group, from a thread of its own: first what a forward reads (the
// parameters and buffers), then the rest (the optimizer's moments and
// counters, the generator). A receiving rank starts its forward once the
// first part has landed (forward_state_landed) and takes the rest at the
// update (training_state::set_update_fence), while its forward and backward
// ran: what the transfer costs the others is the first part, not the
// whole state. The root sends the state it held when the step began
// (parameters and moments change only in its update, which waits for the
// send; what a forward may change is copied first), so every rank applies
// the step's summed gradient to the same state, as without a join.
//
// In bf16 (train.precision = bf16) the parameters sent first are the fp32
// masters; the receiver's forward rounds them into its compute copies as
// every forward does (training_state::forward_backward).
//
// Where it applies: train.sync = every_step at train.zero = 0, in either
// precision, a state agreed from a live peer (not read from a checkpoint),
// and a step left to train. Elsewhere the state is broadcast before the
// first step (peer_state).
#include <cstdint>
#include <functional>
#include <memory>

#include "dtactor/result.hpp"
#include "rank/outcome.hpp"

namespace dtactor {

struct start_context;
class state_source;
class heal_transfer;

// Whether this generation's start heals while training (above).
bool heals(const start_context& c);
// The state source that starts the transfer.
std::unique_ptr<state_source> make_healing_state();
// Before the step at `step`: on a rank receiving the state at that step,
// waits until what a forward reads of it has landed (an error: it did not,
// or `abandon` said to stop waiting); elsewhere nothing.
status forward_state_landed(heal_transfer& t, int64_t step, const std::function<bool()>& abandon);

}  // namespace dtactor
