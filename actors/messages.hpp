#pragma once
// The CAF message vocabulary of dtactor's actors.
//
// Wire messages (pb::envelope) reach actors as one `inbound` value, sent by the
// process's bridge (the only owner of sockets); the envelope's body case says
// what it is. Actors send wire messages through an injected `outbound`
// function, so tests capture them without sockets. Everything else between
// actors is an atom-tagged tuple, listed below with its payload.
//
// CAF 0.17 notes: atoms hold at most 10 characters; type-ID checks are off,
// so every custom type here is registered by add_message_types() and has a
// serialization round-trip test (tests/actor_messages_test.cpp).
#include <cstdint>
#include <functional>
#include <string>

#include "actors/membership.hpp"
#include "caf/actor_system_config.hpp"
#include "caf/atom.hpp"
#include "caf/error.hpp"
#include "caf/meta/load_callback.hpp"
#include "caf/meta/type_name.hpp"
#include "caf/sec.hpp"
#include "net/wire.hpp"  // envelope_header, make_envelope (header-only here)
#include "wire.pb.h"

namespace dtactor {

// -- atoms and their messages -------------------------------------------------

// (start_atom): node agent leaves `unregistered` and starts registering.
using start_atom = caf::atom_constant<caf::atom("start")>;
// (tick_atom): periodic timer, every heartbeat interval (liveness, decisions,
// heartbeats). Self-sent with delayed_send through the actor clock.
using tick_atom = caf::atom_constant<caf::atom("tick")>;
// (decide_atom): the membership actor's own: judge the membership now (a
// rank became ready, a settle window ended) rather than at the next tick.
using decide_atom = caf::atom_constant<caf::atom("decide")>;
// (retry_atom, uint64_t attempt): node agent's registration retry timer; stale
// attempts are ignored.
using retry_atom = caf::atom_constant<caf::atom("retry")>;
// (lost_atom, std::string node_id, double detected_after_s): membership actor
// -> job actor when the failure detector declares a node lost.
using lost_atom = caf::atom_constant<caf::atom("lost")>;
// (plan_atom, plan) -> int64_t start_step: membership actor -> job actor when
// a generation starts; the reply is the committed step everyone resumes from.
using plan_atom = caf::atom_constant<caf::atom("plan")>;
// (rank_exit_atom, int32_t pid, int32_t exit_code):
// whoever owns the process_launcher -> node agent when a rank process ended
// (exit_code: exit status, or 128 + signal number when killed).
using rank_exit_atom = caf::atom_constant<caf::atom("rankexit")>;
// (restart_atom, int32_t local_rank, uint64_t epoch): node agent's own
// backoff timer before restarting a rank.
using restart_atom = caf::atom_constant<caf::atom("restart")>;
// (leave_atom, std::string reason): node agent tells the coordinator it leaves
// (preemption notice); its ranks finish their step under the drain plan.
using leave_atom = caf::atom_constant<caf::atom("leave")>;
// (leave_due_atom): a leaving node agent's own timer: no drain plan came in
// time; its ranks are stopped.
using leave_due_atom = caf::atom_constant<caf::atom("leavedue")>;
// (stop_atom, std::string reason) -> job actor: stop the job (a signal);
// ranks stop after a final checkpoint and the end is a stop, not a finish.
// (stop_atom) job actor -> membership actor: plan no further generation
// (nodes leaving now are part of the stop, not a reason to re-form the world).
using stop_atom = caf::atom_constant<caf::atom("stop")>;

// (members_atom, caf::actor membership): wiring -> job actor, once both
// exist: the job's end goes out to the nodes through the membership actor.
using members_atom = caf::atom_constant<caf::atom("members")>;
// (ckpt_atom, int64_t step, std::vector<int64_t> kept): checkpoint
// committer -> membership actor: a checkpoint committed, and the steps of
// those left in the store after its rotation (empty: not known). A
// generation with no surviving state starts from the newest no rank refused
// (its global rank 0 loads it from the store; actors/checkpoint_choice.hpp).
using ckpt_atom = caf::atom_constant<caf::atom("ckpt")>;
// (fail_atom, std::string reason): membership actor -> job actor: nothing
// can go on (every checkpoint a plan could name was refused by a rank): the
// job fails with this line.
using fail_atom = caf::atom_constant<caf::atom("fail")>;
// (flush_atom) -> bool: job actor -> checkpoint writer; answered once every
// checkpoint sent before it was handled.
using flush_atom = caf::atom_constant<caf::atom("flush")>;
// (shutdown_atom, std::string reason, bool checkpoint) -> bool: job actor ->
// membership actor: send `shutdown` to every node that registered (with
// checkpoint: ranks stop after a final checkpoint). Answered once queued:
// true while some node is a member (false: every node left or was lost,
// nobody will answer a stop).
using shutdown_atom = caf::atom_constant<caf::atom("shutdown")>;
// (wait_atom): anyone -> job actor; answered with (done_atom, int exit_code)
// when the job has ended.
using wait_atom = caf::atom_constant<caf::atom("wait")>;
using done_atom = caf::atom_constant<caf::atom("done")>;
// (stop_due_atom): a stop's own timer. Job actor: the ranks did not all stop
// within job_options::stop_timeout after a stop was asked for. Node agent:
// no final shutdown came within its stop_timeout while the job stops; its
// ranks are stopped.
using stop_due_atom = caf::atom_constant<caf::atom("stopdue")>;

// (report_atom, uint64_t generation, inbound): a rank's training thread ->
// its rank actor: a report (in inbound.env) of that generation.
using report_atom = caf::atom_constant<caf::atom("report")>;
// (refused_atom, std::string reason): a node's process learns that the
// coordinator refused its node for good (node_event nev::refused).
using refused_atom = caf::atom_constant<caf::atom("refused")>;
// (gave_up_atom, std::string reason): a node's process learns that its node
// gave every rank up and left the job (node_event nev::gave_up).
using gave_up_atom = caf::atom_constant<caf::atom("gaveup")>;
// (closed_atom, std::string peer): the coordinator's bridge -> membership
// actor: the connection of the node at routing id `peer` closed.
using closed_atom = caf::atom_constant<caf::atom("closed")>;
// (reachable_atom, std::string endpoint): a node's bridge -> node agent:
// its connection to the coordinator address `endpoint` came up (a
// coordinator listens there now).
using reachable_atom = caf::atom_constant<caf::atom("reachable")>;

// -- wire messages ------------------------------------------------------------

// Link names the bridges use.
namespace links {
inline constexpr const char* nodes = "nodes";              // coordinator side of coordinator<->node
inline constexpr const char* coordinator = "coordinator";  // node side of coordinator<->node
inline constexpr const char* ranks = "ranks";              // node side of node<->rank
inline constexpr const char* relay_in = "relay_in";        // a node's listener for its relay group's heartbeats (actors/relays.hpp)
inline constexpr const char* relay = "relay";              // a node's link to its group's relay
}  // namespace links

// One frame received by a bridge: on which link, from which peer (the bridge's
// opaque routing id; replies go to the same peer string), and the envelope the
// bridge has parsed and checked (protocol version, job id).
struct inbound {
  std::string link;
  std::string peer;
  pb::envelope env;
  sender_id from;  // env.sender(), parsed once here

  inbound() = default;
  inbound(std::string l, std::string p, pb::envelope e)
      : link(std::move(l)), peer(std::move(p)), env(std::move(e)), from(sender_id::parse(env.sender())) {}
};

// CAF 0.17 inspect: the envelope travels as its Protobuf bytes.
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, inbound& x) {
  std::string bytes;
  if constexpr (Inspector::reads_state) x.env.SerializeToString(&bytes);
  auto load = caf::meta::load_callback([&]() -> caf::error {
    if (!x.env.ParseFromString(bytes)) return caf::make_error(caf::sec::invalid_argument, "dtactor::inbound: envelope bytes do not parse");
    x.from = sender_id::parse(x.env.sender());
    return caf::none;
  });
  return f(caf::meta::type_name("dtactor::inbound"), x.link, x.peer, bytes, load);
}

// How actors send: link, peer (as received in `inbound`), envelope. Called on
// the actor's thread; the bridge's implementation must only enqueue (never
// block) and be safe to call from any thread.
using outbound = std::function<void(const std::string& link, const std::string& peer, pb::envelope env)>;

// Where actors write one line per event worth a journal entry (may be empty).
using log_fn = std::function<void(const std::string& line)>;
inline void log_line(const log_fn& log, const std::string& line) {
  if (log) log(line);
}


// -- inspect overloads for plan (travels in plan_atom messages) --------------

// A node id travels as its text.
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_id& x) {
  std::string text = x.str();
  auto load = caf::meta::load_callback([&]() -> caf::error {
    x = node_id{std::move(text)};
    return caf::none;
  });
  return f(caf::meta::type_name("dtactor::node_id"), text, load);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, plan_node& x) {
  return f(caf::meta::type_name("dtactor::plan_node"), x.node_id, x.advertise_addr, x.peer, x.node_rank, x.nproc, x.first_global_rank, x.incarnation,
           x.local_ranks);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rank_slot& x) {
  return f(caf::meta::type_name("dtactor::rank_slot"), x.node_id, x.local_rank, x.global_rank, x.ready_serial);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, plan& x) {
  return f(caf::meta::type_name("dtactor::plan"), x.generation, x.world_size, x.state_root, x.nodes, x.ranks, x.drain, x.cause, x.adopted, x.leaving);
}

// Registers the custom message types (needed to deserialize them inside a
// caf::message, e.g. across CAF nodes or in the round-trip tests). Call on
// every actor_system_config that runs these actors.
void add_message_types(caf::actor_system_config& cfg);

}  // namespace dtactor
