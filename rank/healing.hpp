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
// In bf16 (train.precision = bf16) at train.zero = 0 the parameters sent
// first are the fp32 masters; the receiver's forward rounds them into its
// compute copies as every forward does (training_state::forward_backward).
//
// At train.zero = 1 and 2 the optimizer's moments are resharded to the
// generation's plan on the same thread, after the state: every rank plans
// its moves on the generation's thread (rank/zero plan_reshard: who holds
// what, the new windows), then sends and receives them while the step
// trains; the moments a rank sends are in windows the update no longer
// reads (retired), and every rank's update waits for its own moves and
// for one word from every rank saying theirs landed, so either every rank
// applies the step or none does.
//
// bf16 at train.zero = 1 and 2 shards the fp32 masters too: the root holds
// only its shards', while every rank holds every bf16 copy, current. So
// the parameters sent first are the root's bf16 copies, each rank's
// masters move with its moments, and the first step computes with the
// copies as they are (flat_adamw::keep_compute_once: some held windows'
// masters are still on their way). The pages of the masters a rank no
// longer holds are given back at the update, once the moves that may read
// them are done (after_landing; before the first step without healing).
//
// Where it applies: train.sync = every_step, a state agreed from a live
// peer (not read from a checkpoint), and a step left to train; at
// train.zero = 0, 1 and 2 in either precision where no rank's parameters
// are a mix of two steps (its last all-gather failed); not at train.zero =
// 3 (a rank holds its shards' parameters only).
// Elsewhere the state is broadcast and the moments moved before the first
// step (peer_state, replica_shards).
#include <cstdint>
#include <functional>
#include <memory>

#include "dtactor/result.hpp"
#include "rank/outcome.hpp"

namespace dtactor {

struct start_context;
struct job_settings;
class state_source;
class heal_transfer;
class shard_source;

// Whether this generation's start heals while training (above).
bool heals(const start_context& c);
// train.zero >= 1, every step: a rank's optimizer windows (and, where
// the masters are sharded, its masters) come from the reshard or the
// checkpoint, never from the state a peer sends, so a rank not holding
// the agreed step drops its stale ones before that state comes.
bool windows_from_reshard(const job_settings& s);
// The state source that starts the transfer (at train.zero >= 1, every
// rank has one, started by the shard source below).
std::unique_ptr<state_source> make_healing_state();
// train.zero >= 1: the shard source that plans the moments' reshard and
// starts the transfer with its moves.
std::unique_ptr<shard_source> make_healing_shards();
// This rank receives the state (parameters, buffers, counters) while the
// first step trains.
bool receives_while_training(const heal_transfer& t);
// Runs `f` at the update, once every rank's moves landed (not at all when
// they did not: the generation fails).
void after_landing(heal_transfer& t, std::function<void()> f);
// Before the step at `step`: on a rank receiving the state at that step,
// waits until what a forward reads of it has landed (an error: it did not,
// or `abandon` said to stop waiting); elsewhere nothing.
status forward_state_landed(heal_transfer& t, int64_t step, const std::function<bool()>& abandon);

}  // namespace dtactor
