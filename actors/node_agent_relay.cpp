// The node agent's side of heartbeat relays (actors/relays.hpp): beating a
// relay instead of the coordinator, and relaying a group's beats.
#include <algorithm>

#include "actors/node_agent_detail.hpp"
#include "base/printable.hpp"
#include "caf/stateful_actor.hpp"

namespace dtactor::node_agent_detail {

namespace {

std::chrono::milliseconds ms_of(clock_duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d); }

void dial(agent_self self, const std::string& endpoint) {
  auto& st = self->state;
  if (st.opts.dial_relay) st.opts.dial_relay(endpoint);
  if (endpoint.empty())
    log_line(self, "heartbeats go to the coordinator");
  else
    log_line(self, "heartbeats go to relay '" + printable(st.relay.relay_id()) + "' at " + printable(endpoint));
}

}  // namespace

std::chrono::milliseconds beat_interval(const node_agent_state& st) {
  return st.heartbeat_every.count() > 0 ? st.heartbeat_every : st.opts.liveness.heartbeat_interval;
}

void take_relay(agent_self self, const pb::relay_assignment& a) {
  auto& st = self->state;
  st.group_relay = a;
  if (auto d = st.relay.assign(a, st.opts.node_id.str(), self->clock().now())) dial(self, *d);
}

void drop_relay(agent_self self) {
  auto& st = self->state;
  const bool had = !st.relay.endpoint().empty();
  st.relay.reset();
  st.group_relay.Clear();
  if (had && st.opts.dial_relay) st.opts.dial_relay("");
}

void on_coordinator_ack(agent_self self, const pb::heartbeat_ack& ack) {
  auto& st = self->state;
  take_relay(self, ack.relay());
  // A member of a relay group beats at the members' interval, which its
  // relay passes on; the coordinator's ask is for its own beats.
  if (st.relay.endpoint().empty()) st.heartbeat_every = std::chrono::milliseconds(ack.interval_ms());
  if (ack.refused_size() > 0) st.hub.refuse({ack.refused().begin(), ack.refused().end()});
}

void on_relay_member(agent_self self, const inbound& in) {
  auto& st = self->state;
  if (!member(st) || in.env.body_case() != pb::envelope::kHeartbeat || in.from.who != sender_id::role::node) return;
  const auto now = self->clock().now();
  auto out = envelope(self);
  if (st.hub.take_refusal(in.from.node)) {
    auto* ack = out.mutable_register_ack();
    ack->set_accepted(false);
    ack->set_node_rank(-1);
    ack->set_job_id(st.job_id);
    ack->set_reason("node '" + in.from.node + "' is not a member (declared lost, restarted, or the coordinator restarted); register again");
  } else {
    st.hub.heard(in.from.node, relay_hub::beat{in.env.incarnation(), in.env.generation(), in.env.heartbeat().step(), now});
    auto* ack = out.mutable_heartbeat_ack();
    ack->set_seq(in.env.heartbeat().seq());
    ack->set_echoed_sent_steady_s(in.env.heartbeat().sent_steady_s());
    *ack->mutable_relay() = st.group_relay;
    ack->set_interval_ms(st.group_relay.interval_ms());
    ack->set_from_relay(true);
    ack->set_coordinator_age_ms(static_cast<uint32_t>(std::min<int64_t>(ms_of(now - std::min(now, st.last_heard)).count(), UINT32_MAX)));
  }
  st.out(links::relay_in, in.peer, std::move(out));
}

void on_relay_answer(agent_self self, const inbound& in) {
  auto& st = self->state;
  if (!member(st) || st.relay.endpoint().empty()) return;
  const auto now = self->clock().now();
  if (in.env.body_case() == pb::envelope::kRegisterAck && !in.env.register_ack().accepted()) {
    // The coordinator's refusal, passed on: register again.
    st.relay.acked(now);
    return on_register_ack(self, in.env.register_ack());
  }
  if (in.env.body_case() != pb::envelope::kHeartbeatAck || !in.env.heartbeat_ack().from_relay()) return;
  const auto& ack = in.env.heartbeat_ack();
  st.relay.acked(now);
  // The relay heard the coordinator that long ago: so, through it, did we.
  st.last_heard = std::max(st.last_heard, now - std::chrono::milliseconds(ack.coordinator_age_ms()));
  emit(self, nev::heartbeat_acked{ack.echoed_sent_steady_s()});
  take_relay(self, ack.relay());
  if (!st.relay.endpoint().empty()) st.heartbeat_every = std::chrono::milliseconds(ack.interval_ms());
}

bool given_up_relay(agent_self self, clock_time now) {
  auto& st = self->state;
  const auto relay = st.relay.relay_id();
  const auto grace = st.relay.answered_since_dial() ? relay_grace(st.opts.liveness) : relay_first_grace(st.opts.liveness);
  if (!st.relay.given_up(now, relay_grace(st.opts.liveness), relay_first_grace(st.opts.liveness), 2 * st.opts.liveness.heartbeat_timeout)) return false;
  log_line(self, "relay '" + printable(relay) + "' did not answer for " + std::to_string(ms_of(grace).count()) + " ms");
  dial(self, "");
  st.heartbeat_every = std::chrono::milliseconds(0);
  return true;
}

void send_heartbeat(agent_self self, clock_time now) {
  auto& st = self->state;
  auto env = envelope(self);
  auto* hb = env.mutable_heartbeat();
  hb->set_seq(++st.heartbeat_seq);
  hb->set_sent_steady_s(std::chrono::duration<double>(now.time_since_epoch()).count());
  hb->set_step(st.last_step);
  hb->set_node_rank(st.node_rank);
  st.last_beat = now;
  if (!st.relay.endpoint().empty()) {
    st.relay.beat(now);
    st.out(links::relay, "", std::move(env));
    return;
  }
  st.hub.fill(*hb, now, st.opts.liveness.heartbeat_timeout);
  const bool ask = st.heartbeat_seq == 1 || now - st.ack_asked >= ack_every(st.opts.liveness);
  hb->set_no_ack(!ask);
  if (ask) st.ack_asked = now;
  to_coordinator(self, std::move(env));
}

}  // namespace dtactor::node_agent_detail
