#pragma once
// The control side of a rank process: relays the node's plans and stops to
// the training thread (rank/rank_worker, behind `rank_work`: actors/rank_work.hpp),
// the thread's reports (stamped with their generation) to the node, and
// heartbeats the node every interval so it can tell a hung rank from a busy
// one. Time only through CAF's clock, sockets only through `send`: tests
// drive it with CAF's test coordinator and a fake worker.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "actors/messages.hpp"
#include "actors/rank_work.hpp"
#include "caf/replies_to.hpp"
#include "caf/stateful_actor.hpp"
#include "caf/typed_actor.hpp"
#include "caf/typed_event_based_actor.hpp"
#include "wire.pb.h"

namespace dtactor {

struct rank_actor_options {
  envelope_header header;  // sender "rank/<node>/<local rank>", this process's incarnation
  std::string node_id;
  int32_t local_rank = 0;  // -1: a warm spare until the node gives it a slot (spare_slot)
  int32_t pid = 0;         // this process, for the node's hello
  std::chrono::milliseconds heartbeat_interval{100};
  // Sends one envelope to the node agent (enqueues; never blocks).
  std::function<void(pb::envelope)> send;
  // Starts the training thread with the callbacks that reach this actor.
  std::function<std::unique_ptr<rank_work>(rank_work_callbacks)> make_work;
};

struct rank_actor_state {
  rank_actor_options opts;
  std::unique_ptr<rank_work> work;
  uint64_t heartbeat_seq = 0;
  uint64_t newest_plan = 0;  // newest generation the worker took
  uint64_t reports = 0;      // reports relayed
  static inline const char* name = "dtactor.rank";
};

// What the rank actor takes:
// (start_atom): hello to the node, then a heartbeat every interval.
// (tick_atom): its own timer: a heartbeat to the node.
// (report_atom, generation, inbound): a report from the training thread.
// inbound from the node: generation_plan -> offered to the worker; shutdown
//   with checkpoint -> request_stop(true); shutdown -> quit() and the actor ends;
//   spare_slot (a spare only) -> it is that local rank from now on.
using rank_actor_handle =
    caf::typed_actor<caf::reacts_to<start_atom>, caf::reacts_to<tick_atom>, caf::reacts_to<report_atom, uint64_t, inbound>, caf::reacts_to<inbound>>;

rank_actor_handle::behavior_type rank_actor(rank_actor_handle::stateful_pointer<rank_actor_state> self, rank_actor_options opts);

}  // namespace dtactor
