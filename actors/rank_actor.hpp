#pragma once
// The control side of a rank process: relays the node's plans and stops to
// the training thread (rank/rank_worker, behind the `rank_work` interface),
// the thread's reports (stamped with their generation) to the node, and
// heartbeats the node every interval so it can tell a hung rank from a busy
// one. Time only through CAF's clock, sockets only through `send`: tests
// drive it with CAF's test coordinator and a fake worker.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "actors/messages.hpp"
#include "caf/behavior.hpp"
#include "caf/event_based_actor.hpp"
#include "caf/stateful_actor.hpp"
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
};

struct rank_actor_options {
  envelope_header header;  // sender "rank/<node>/<local rank>", this process's incarnation
  int32_t local_rank = 0;
  int32_t pid = 0;  // this process, for the node's hello
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

// (start_atom): hello to the node, then a heartbeat every interval.
// (report_atom, generation, inbound): a report from the training thread.
// inbound generation_plan -> offered to the worker; shutdown with
// checkpoint -> request_stop(true); shutdown -> quit() and the actor ends.
caf::behavior rank_actor(caf::stateful_actor<rank_actor_state>* self, rank_actor_options opts);

}  // namespace dtactor
