#pragma once
// The node agent's parts shared between its files (actors/node_agent.cpp,
// actors/node_agent_relay.cpp); not for anyone else.
#include <string>

#include "actors/node_agent.hpp"

namespace dtactor::node_agent_detail {

using agent_self = node_agent_handle::stateful_pointer<node_agent_state>;

pb::envelope envelope(agent_self self);
void to_coordinator(agent_self self, pb::envelope env);
void log_line(agent_self self, const std::string& line);
bool member(const node_agent_state& st);
void emit(agent_self self, node_event e);
void on_register_ack(agent_self self, const pb::register_ack& ack);

// Heartbeat relays (actors/relays.hpp), node_agent_relay.cpp:
// where to beat, as the coordinator or the relay said (register_ack,
// heartbeat_ack); dials or closes the link to the relay.
void take_relay(agent_self self, const pb::relay_assignment& a);
// Back to the coordinator (a registration): the relay link closes.
void drop_relay(agent_self self);
// A member's beat on links::relay_in (this node relays for its group).
void on_relay_member(agent_self self, const inbound& in);
// Its relay's answer on links::relay.
void on_relay_answer(agent_self self, const inbound& in);
// The coordinator's heartbeat_ack: its relay assignment and the relayed
// members it refused.
void on_coordinator_ack(agent_self self, const pb::heartbeat_ack& ack);
// A relay that left a beat unanswered for relay_grace is given up: true
// then, and the node beats the coordinator now.
bool given_up_relay(agent_self self, clock_time now);
// One heartbeat: to the relay (an answer asked every time), or to the
// coordinator with the group's beats this node relays, asking for an ack
// when the last ask is ack_every old.
void send_heartbeat(agent_self self, clock_time now);
// The interval this agent beats at: the coordinator's or relay's ask, else
// the job's.
std::chrono::milliseconds beat_interval(const node_agent_state& st);

}  // namespace dtactor::node_agent_detail
