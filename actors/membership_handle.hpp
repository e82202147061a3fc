#pragma once
// The membership actor's interface (its behaviour: actors/membership_actor.hpp),
// apart from the actor because the job actor and the checkpoint writer,
// which the membership actor holds, hold it too.
#include <cstdint>
#include <string>
#include <vector>

#include "actors/messages.hpp"
#include "caf/replies_to.hpp"
#include "caf/typed_actor.hpp"
#include "caf/typed_event_based_actor.hpp"

namespace dtactor {

// inbound: a node's frame (from the bridge).
// (closed_atom, peer): the connection of the node at routing id `peer` closed.
// (tick_atom): its own timer.
// (decide_atom): its own: judge the membership now.
// (stop_atom): plan no further generation.
// (ckpt_atom, step, kept): a committed checkpoint and the steps left in the store.
// (shutdown_atom, reason, checkpoint) -> bool: `shutdown` to every node;
//   true while some node is a member.
using membership_handle = caf::typed_actor<caf::reacts_to<inbound>, caf::reacts_to<closed_atom, std::string>, caf::reacts_to<tick_atom>, caf::reacts_to<stop_atom>,
                                           caf::reacts_to<decide_atom>,
                                           caf::reacts_to<ckpt_atom, int64_t, std::vector<int64_t>>,
                                           caf::replies_to<shutdown_atom, std::string, bool>::with<bool>>;

}  // namespace dtactor
